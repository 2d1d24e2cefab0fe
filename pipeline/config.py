"""The project config file (`pipeline.yaml`): one pydantic schema, env overrides.

Precedence, highest first: environment (`PIPELINE_<SECTION>__<FIELD>`, e.g.
`PIPELINE_FLEET__MAX_LORA_RANK=32`; `MLFLOW_TRACKING_URI` for the registry), the YAML
file, the defaults below. Relative paths in the file are resolved against the file's
directory; without a file, against the working directory.

The project is found the way git finds a repository: `--config`, `$PIPELINE_CONFIG`, else the
nearest `pipeline.yaml` walking up from the working directory, else the nearest directory holding
the embedded store (`.state/mlflow.db`). The walk stops at a directory holding `.git` (a
repository's root) or the filesystem's root. Without either, the working directory is the
project root (`ProjectConfig.found` is False): commands that only read say so instead of
creating an empty store there.

Errors: `ConfigError` names the file and the offending field.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import yaml
from pydantic import AliasChoices, BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from pipeline.artifacts.bounded import MIB, BoundsError, check_json_bounds, load_yaml_file
from pipeline.config_errors import explain
from pipeline.errors import ConfigError
from pipeline.redact import add_secret, redact_uri
from pipeline.serving.vllm import LORA_RANKS

CONFIG_ENV = "PIPELINE_CONFIG"
DEFAULT_CONFIG_NAME = "pipeline.yaml"
DEFAULT_STATE_DIR = ".state"
EMBEDDED_DB = "mlflow.db"
MAX_CONFIG_BYTES = 1 * MIB


class _Section(BaseModel):
    # NaN and infinity are never a setting (an infinite timeout overflowed the clock: a traceback)
    model_config = {"extra": "forbid", "allow_inf_nan": False}


DAY_S = 86400.0  # upper bound of every timeout and wait, seconds


class BaseModelSection(_Section):
    """The bf16 base the adapter is trained on."""

    model: str = Field("tiny-qwen3.5", description="HF id or local path given to axolotl as base_model")
    revision: str | None = Field(None, description="pinned snapshot revision (commit sha) of the base")
    path: Path | None = Field(None, description="local checkpoint dir used for validation (headers only)")


class ServedSection(_Section):
    """The checkpoint the fleet actually serves (e.g. NVFP4 + MTP)."""

    checkpoint: str = Field("tiny-qwen3.5", description="served checkpoint id (e.g. an NVFP4 ModelOpt repo)")
    revision: str | None = None
    path: Path | None = Field(None, description="local copy of the served checkpoint (config + index only)")
    model: str = Field(
        "tiny-qwen3.5",
        description="the exact model string given to `vllm serve`; becomes base_model_name_or_path",
    )
    served_model_name: str | None = Field(None, description="vLLM --served-model-name, if set")

    @property
    def base_name(self) -> str:
        """The string vLLM lists as the adapter's `parent` (served name, else the model string)."""
        return self.served_model_name or self.model


def http_base_url(v: str) -> str:
    """`v` without a trailing slash if it is an http(s) URL with a host, a valid port (not 0), no white
    space, query, fragment or credentials (a path prefix, e.g. behind a gateway, is kept).

    Raises ValueError saying what is wrong (pydantic reports it with the field's location).
    """
    example = "like http://10.0.0.5:8000"
    if v != v.strip() or any(c.isspace() for c in v):
        raise ValueError(f"{v!r} holds white space: write the base URL {example}")
    parts = urlsplit(v)
    try:
        port = parts.port
    except ValueError as e:
        raise ValueError(f"{v!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{v!r} is not an http(s) base URL {example}")
    if port == 0:
        raise ValueError(f"{v!r}: port 0 is not a server's port")
    if parts.query or parts.fragment or "?" in v or "#" in v:
        raise ValueError(f"{v!r}: a base URL has no query or fragment ({example})")
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            f"{parts._replace(netloc='***@' + (parts.hostname or '')).geturl()!r}: credentials in a URL are "
            "printed by status commands; put the API key in an environment variable named by api_key_env"
        )
    return v.rstrip("/")


class Instance(_Section):
    name: str = Field(
        min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="unique instance name"
    )
    url: str = Field(description="base URL, e.g. http://10.0.0.5:8000")
    api_key_env: str | None = Field(None, description="environment variable holding the API key")

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        return http_base_url(v)

    def api_key(self) -> str | None:
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        add_secret(key)  # never printed, whatever its variable is called (pipeline.redact)
        return key


class FleetSection(_Section):
    """What the fleet's vLLM instances accept (their start-up flags)."""

    vllm_version: str = "0.19.2"
    max_lora_rank: int = Field(16, description="vLLM --max-lora-rank")
    lora_target_modules: list[str] | None = Field(None, description="vLLM --lora-target-modules, if set")
    allow_embedding_targets: bool = Field(False, description="fleet serves embed_tokens/lm_head LoRA")
    fully_sharded_loras: bool = Field(False, description="vLLM --fully-sharded-loras")
    speculative_mtp: bool = Field(
        True,
        description="instances draft with the served checkpoint's MTP layer (--speculative-config method mtp)",
    )
    loading_mode: Literal["api", "resolver"] = "api"
    min_acceptance_ratio: float | None = Field(
        None,
        ge=0,
        description="floor of the PREDICTED MTP acceptance length with the adapter / the base's "
        "(`validate --behaviour`, `run`: pipeline.validate.acceptance); None: a warning below 0.9, not gated",
    )
    lora_speed_factor: float = Field(
        0.93,
        gt=0,
        le=1,
        description="decode tok/s with the LoRA kernels / without, at equal MTP acceptance: the predicted "
        "speed ratio's cost factor (0.93: the 5-9% measured on the H200, issue 38, docs/drafter.md)",
    )
    volume_mount: str = Field("/loras", description="where instances see the adapter volume")
    keep_versions: int = Field(2, ge=1, description="version names kept loaded per adapter")
    instances: list[Instance] = Field(default_factory=list)
    timeout_s: float = Field(
        30.0, gt=0, le=DAY_S, description="read timeout of a request (status, verify, canary), seconds"
    )
    connect_timeout_s: float = Field(
        5.0, gt=0, le=DAY_S, description="TCP connect timeout per request, seconds"
    )
    load_timeout_s: float = Field(
        120.0,
        gt=0,
        le=DAY_S,
        description="read timeout of load/unload requests (the CPU engine can take minutes), seconds",
    )
    min_healthy: int | None = Field(
        None,
        ge=1,
        description="publish completes when this many instances switched and the others only did not answer "
        "(unreachable/hung); None: every instance (all-or-nothing)",
    )
    swap_strategy: Literal["auto", "versioned", "repoint"] = Field(
        "auto",
        description="how a new version replaces the old on an instance (pipeline.serving.swap); auto: by vLLM version",
    )
    canary_prompt: str = Field(
        "Hello, the weather in Tokyo is", description="prompt of the post-switch canary"
    )
    canary_max_tokens: int = Field(8, ge=1, description="greedy tokens the canary compares with the base")
    lock_timeout_s: float = Field(
        300.0, ge=0, le=DAY_S, description="wait for another fleet operation's lock, seconds"
    )

    @field_validator("max_lora_rank")
    @classmethod
    def _rank_allowed(cls, v: int) -> int:
        if v not in LORA_RANKS:
            raise ValueError(f"max_lora_rank {v} is not one of vLLM's {LORA_RANKS}")
        return v

    @model_validator(mode="after")
    def _instances_consistent(self) -> FleetSection:
        names = [i.name for i in self.instances]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"instance names must be unique; repeated: {', '.join(dup)}")
        urls = [i.url for i in self.instances]
        dup = sorted({u for u in urls if urls.count(u) > 1})
        if dup:
            raise ValueError(f"two instances with one URL would be switched twice: {', '.join(dup)}")
        if self.instances and self.min_healthy is not None and self.min_healthy > len(self.instances):
            raise ValueError(
                f"min_healthy {self.min_healthy} is more than the {len(self.instances)} instances: "
                "no publish could complete; set it to at most the instance count, or remove it"
            )
        return self


class RegistrySection(_Section):
    tracking_uri: str | None = Field(None, description="MLflow tracking URI; default sqlite in state_dir")
    registry_uri: str | None = None
    experiment: str = "lora-pipeline"
    artifact_location: str | None = Field(
        None,
        description="artifact store for the experiment, e.g. s3://bucket/prefix; default <state_dir>/mlartifacts",
    )
    connect_timeout_s: float = Field(
        5.0,
        gt=0,
        le=DAY_S,
        description="seconds to reach the store (connect, /health, a locked sqlite) before failing",
    )


def _not_empty(v):
    """An empty path setting (`PIPELINE_STATE_DIR=`) would silently be the working directory."""
    if isinstance(v, str) and not v.strip():
        raise ValueError("is empty: give a directory")
    return v


class VolumeSection(_Section):
    path: Path = Field(Path("adapters/volume"), description="where the pipeline writes the adapter volume")
    fleet_user: str | int | None = Field(
        None,
        description="the local user (name or uid) the fleet's vLLM reads the volume as; publish checks that "
        "user can read every directory from / to each file. None: any user, so the volume root and all "
        "below it must be readable by all (docs/fleet.md, 'Who may read the volume')",
    )
    _path_not_empty = field_validator("path", mode="before")(_not_empty)


class TrainSection(_Section):
    runs_dir: Path = Path("adapters/runs")
    _runs_not_empty = field_validator("runs_dir", mode="before")(_not_empty)
    peak_tflops: float | None = Field(
        None, gt=0, description="per-GPU bf16 peak for MFU; default by GPU name"
    )
    max_dropped_share: float = Field(
        0.1,
        ge=0,
        le=1,
        description="largest share of a split's conversations or trainable tokens axolotl may drop "
        "(too long, too short, nothing trainable) before `pipeline train` refuses (--allow dataset.dropped)",
    )


class RunSection(_Section):
    """Gates of the unattended `pipeline run`."""

    eval_loss_margin: float = Field(
        0.05,
        ge=0,
        description="max eval-loss increase over production (nats); above the run-to-run spread of "
        "identical retrains (docs/registry.md, 'Gates on the version': 0.0205 measured on the tiny demo)",
    )


class CanarySection(_Section):
    """`pipeline canary` on a staging vLLM instance, and the publish gate on its recorded result."""

    staging_url: str | None = Field(
        None, description="base URL of the staging vLLM instance (--staging overrides)"
    )
    staging_api_key_env: str | None = Field(None, description="environment variable holding its API key")

    @field_validator("staging_url")
    @classmethod
    def _staging_url(cls, v: str | None) -> str | None:
        return None if v is None else http_base_url(v)

    staging_dir: Path | None = Field(
        None, description="where a registered version is unpacked for staging; default <state_dir>/canary"
    )
    staging_mount: str | None = Field(
        None, description="where the staging instance sees staging_dir (default: the same absolute path)"
    )
    prompts: int = Field(
        8, ge=1, description="validation-split prompts in the canary set (plus the tool-call ones)"
    )
    max_tokens: int = Field(16, ge=1, description="greedy tokens generated per canary prompt")
    top_logprobs: int = Field(5, ge=1, le=20, description="top logprobs compared per generated token")
    reference_dtype: Literal["float32", "bfloat16"] = Field("float32", description="PEFT reference precision")
    min_token_agreement: float = Field(
        0.95, ge=0, le=1, description="engine tokens equal to the reference argmax"
    )
    max_logprob_diff: float = Field(
        0.1, ge=0, description="max |engine - reference| logprob over top tokens, nats"
    )
    tie_margin: float = Field(
        0.01,
        ge=0,
        description="a different token within this many nats of the reference argmax counts as agreeing",
    )
    quantized: bool | None = Field(
        None,
        # `quantised`: the spelling before issue 26; pipeline.yaml files written then still load
        validation_alias=AliasChoices("quantized", "quantised"),
        description="the staging base is quantized (None: read the served checkpoint's config)",
    )
    base_gap_factor: float = Field(
        2.0, ge=1, description="quantized base: tolerance = max(threshold, factor x the base's own gap)"
    )
    min_quantized_base_agreement: float = Field(
        0.5,
        ge=0,
        le=1,
        description="quantized base: below this token agreement of the base alone, a tolerance from its gap "
        "proves nothing about the adapter and the canary fails (canary.base_gap)",
    )
    min_speed_ratio: float | None = Field(
        None,
        ge=0,
        description="floor of adapter/base decode speed (base TPOT / adapter TPOT); None: not gated",
    )
    min_acceptance_ratio: float | None = Field(
        None, ge=0, description="floor of adapter/base mean acceptance length; None: not gated"
    )
    min_effect_retention: float | None = Field(
        None,
        ge=0,
        description="floor of the adapter's teacher-forced shift on the engine / on the PEFT reference "
        "(pipeline.canary.effect); None: not gated",
    )
    required: bool = Field(
        False, description="publish refuses a version without a passing canary for its weights"
    )
    timeout_s: float = Field(
        120.0, gt=0, le=DAY_S, description="per-request HTTP timeout to the staging instance, seconds"
    )


class ProjectConfig(BaseSettings):
    """Schema of `pipeline.yaml`."""

    model_config = SettingsConfigDict(env_prefix="PIPELINE_", env_nested_delimiter="__", extra="forbid")

    state_dir: Path = Path(".state")
    base: BaseModelSection = Field(default_factory=BaseModelSection)
    served: ServedSection = Field(default_factory=ServedSection)
    fleet: FleetSection = Field(default_factory=FleetSection)
    registry: RegistrySection = Field(default_factory=RegistrySection)
    volume: VolumeSection = Field(default_factory=VolumeSection)
    train: TrainSection = Field(default_factory=TrainSection)
    run: RunSection = Field(default_factory=RunSection)
    canary: CanarySection = Field(default_factory=CanarySection)

    source: Path | None = Field(None, exclude=True, description="file this config was read from")
    root: Path | None = Field(None, exclude=True, description="project root relative paths resolve against")
    found: bool = Field(
        True, exclude=True, description="a pipeline.yaml or an existing state dir located the project"
    )
    _state_not_empty = field_validator("state_dir", mode="before")(_not_empty)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment beats the file (passed as init kwargs), which beats defaults.
        return (env_settings, init_settings)

    # -- derived locations -------------------------------------------------------------
    @property
    def tracking_uri(self) -> str:
        uri = os.environ.get("MLFLOW_TRACKING_URI") or self.registry.tracking_uri
        return uri or f"sqlite:///{(self.state_dir / 'mlflow.db').resolve()}"

    @property
    def embedded_store(self) -> Path | None:
        """The sqlite file of the embedded default store, or None when a tracking URI is configured."""
        if os.environ.get("MLFLOW_TRACKING_URI") or self.registry.tracking_uri:
            return None
        return (self.state_dir / EMBEDDED_DB).resolve()

    def store_exists(self) -> bool:
        """False only for an embedded default store that was never created (nothing registered yet)."""
        db = self.embedded_store
        return db is None or db.exists()

    def where(self) -> str:
        """One line naming the project and store in use, for messages (credentials redacted)."""
        origin = (
            f"config {self.source}"
            if self.source
            else (f"project {self.root}" if self.found else f"no project found from {self.root}")
        )
        return f"{origin}; registry {redact_uri(self.tracking_uri)}"

    @property
    def artifact_root(self) -> Path:
        return (self.state_dir / "mlartifacts").resolve()

    @property
    def served_base_name(self) -> str:
        """The string vLLM lists as the adapter's `parent` (`ServedSection.base_name`)."""
        return self.served.base_name

    @property
    def served_base_names(self) -> tuple[str, ...]:
        """Every name a client may ask the fleet for the base model by: `served.served_model_name` and
        `served.model` (what `vllm serve` was given); no adapter may take one (`pipeline.artifacts.names`)."""
        return tuple(dict.fromkeys(n for n in (self.served.served_model_name, self.served.model) if n))


def _resolve_paths(cfg: ProjectConfig, root: Path) -> ProjectConfig:
    def fix(p: Path | None) -> Path | None:
        return None if p is None else (p if p.is_absolute() else (root / p)).resolve()

    cfg.state_dir = fix(cfg.state_dir)
    cfg.base.path = fix(cfg.base.path)
    cfg.served.path = fix(cfg.served.path)
    cfg.volume.path = fix(cfg.volume.path)
    cfg.train.runs_dir = fix(cfg.train.runs_dir)
    cfg.canary.staging_dir = fix(cfg.canary.staging_dir)
    return cfg


def find_project(start: Path | None = None) -> tuple[Path | None, Path | None]:
    """(pipeline.yaml, project root) found walking up from `start` (default: the working directory).

    A directory is the project root when it holds `pipeline.yaml` (returned as the first
    element) or the embedded store `.state/mlflow.db` (first element None). The walk stops
    after a directory holding `.git` and at the filesystem root; (None, None) when nothing is found.
    """
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / DEFAULT_CONFIG_NAME).is_file():
            return d / DEFAULT_CONFIG_NAME, d
        if (d / DEFAULT_STATE_DIR / EMBEDDED_DB).is_file():
            return None, d
        if (d / ".git").exists():
            break
    return None, None


def find_config(explicit: Path | None = None) -> Path | None:
    """The config file in effect: explicit path, `$PIPELINE_CONFIG`, or the nearest `pipeline.yaml` up the tree."""
    if explicit is not None:
        return explicit
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV])
    return find_project()[0]


# -- settings from the environment: the same clear errors as settings from the file ------------------
ENV_PREFIX = "PIPELINE_"
# MLflow settings the pipeline's commands depend on (pipeline.registry.store); MLflow parses them
# with int() deep inside a request, so a bad one is refused here, naming the variable.
MLFLOW_INT_ENV = (
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
)


def _pipeline_env() -> dict[str, str]:
    """{VARIABLE (upper-case): name as set} of the PIPELINE_* variables (pydantic-settings ignores case)."""
    return {k.upper(): k for k in os.environ if k.upper().startswith(ENV_PREFIX)}


def _env_var_for(loc: tuple) -> str | None:
    """The variable a validation error's location came from, if it came from the environment."""
    env = _pipeline_env()
    for n in range(len(loc), 0, -1):  # the most specific variable set: PIPELINE_FLEET__X, then PIPELINE_FLEET
        name = ENV_PREFIX + "__".join(str(x) for x in loc[:n]).upper()
        if name in env:
            return env[name]
    # a variable below the location: PIPELINE_FLEET__INSTANCES__0__URL made `fleet.instances` invalid
    below = ENV_PREFIX + "__".join(str(x) for x in loc).upper() + "__"
    return next((env[u] for u in sorted(env) if u.startswith(below)), None)


def _env_json_error(e: Exception) -> str:
    """Which PIPELINE_* variable holds a section (or list) that is not JSON, and how to write it."""
    import json

    complex_fields = {
        name
        for name, f in ProjectConfig.model_fields.items()
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)
    }
    env = _pipeline_env()
    for upper, var in sorted(env.items()):
        parts = upper[len(ENV_PREFIX) :].lower().split("__")
        if parts[0] not in complex_fields:
            continue
        value = os.environ[var]
        if len(parts) == 1 or value.lstrip()[:1] in ("[", "{"):
            try:
                json.loads(value)
            except ValueError as je:
                section = parts[0]
                return (
                    f"${var}: not valid JSON ({je}); a section or a list set from the environment is JSON, e.g. "
                    f"{ENV_PREFIX}{section.upper()}='{{\"...\": ...}}', or set one field: "
                    f"{ENV_PREFIX}{section.upper()}__<FIELD>=value"
                )
    return f"environment: {e}"


def _check_env_names() -> None:
    """`PIPELINE_VOLUME_PATH` (one underscore) is ignored by the settings reader: say so, don't lose it."""
    sections = {
        name: f.annotation
        for name, f in ProjectConfig.model_fields.items()
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)
    }
    for upper, var in sorted(_pipeline_env().items()):
        rest = upper[len(ENV_PREFIX) :].lower()
        for section, model in sections.items():
            field = rest.removeprefix(section + "_")
            if rest.startswith(section + "_") and not field.startswith("_") and field in model.model_fields:
                raise ConfigError(
                    f"${var} is not read: a field of a section is set with two underscores, "
                    f"{ENV_PREFIX}{section.upper()}__{field.upper()}"
                )
    for var in MLFLOW_INT_ENV:
        v = os.environ.get(var)
        if v is not None and not v.strip().isdigit():
            raise ConfigError(f"${var}={v!r}: MLflow reads it as a whole number (>= 0); fix or unset it")
    for var in _pipeline_env().values():  # pydantic-settings parses sections and lists as JSON, unbounded
        value = os.environ[var]
        if value.lstrip()[:1] in ("[", "{"):
            try:
                check_json_bounds(value, f"${var}", MAX_CONFIG_BYTES)
            except BoundsError as e:
                raise ConfigError(f"{e}: a section set from the environment is a small JSON object") from e


def _check_uris(cfg: ProjectConfig, path: Path | None) -> None:
    """A tracking or registry URI that cannot be parsed (a bad port, an unclosed `[`) is a config error."""
    from urllib.parse import urlsplit

    for where, uri in (
        (
            "$MLFLOW_TRACKING_URI"
            if os.environ.get("MLFLOW_TRACKING_URI")
            else f"{path}: registry.tracking_uri",
            cfg.tracking_uri,
        ),
        (
            _env_var_for(("registry", "registry_uri")) or f"{path}: registry.registry_uri",
            cfg.registry.registry_uri,
        ),
    ):
        if not uri:
            continue
        try:
            parts = urlsplit(uri)
            parts.port  # noqa: B018 - raises ValueError for a port that is no number or out of range
        except ValueError as e:
            raise ConfigError(f"{where}: {redact_uri(uri)!r} is not a URI ({e})") from None
        if any(c.isspace() for c in uri):
            raise ConfigError(f"{where}: {redact_uri(uri)!r} holds white space")


def load_config(path: Path | None = None) -> ProjectConfig:
    """Read and validate the project config.

    Raises:
        ConfigError: the file is missing (when given explicitly), not YAML, or fails the schema.
    """
    root: Path | None = None
    found = True
    if path is None and not os.environ.get(CONFIG_ENV):
        path, root = find_project()
        found = root is not None
    else:
        path = find_config(path)
    data: dict = {}
    if path is not None:
        try:
            exists = path.exists()
        except OSError as e:  # a directory on the way this user may not enter
            raise ConfigError(
                f"{path}: cannot read the config file: {e.strerror or e} (uid {os.geteuid()})"
            ) from e
        if not exists:
            raise ConfigError(f"{path}: config file not found (set {CONFIG_ENV} or pass --config)")
        try:
            data = load_yaml_file(path, MAX_CONFIG_BYTES) or {}
        except BoundsError as e:
            raise ConfigError(f"{e}: not a project config") from e
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not a text file (byte {e.start} is not UTF-8)") from e
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config file: {e.strerror or e}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    _check_env_names()
    try:
        cfg = ProjectConfig(**data)
    except SettingsError as e:  # a section given as JSON in the environment that is not JSON
        raise ConfigError(_env_json_error(e)) from e
    except ValidationError as e:
        # the key's line in the file, `did you mean`, or the variable a value came from (pipeline/config_errors.py)
        lines = explain(e.errors(), ProjectConfig, path, _env_var_for)
        raise ConfigError("\n".join([f"{path or 'environment'}: invalid config:", *lines])) from e
    _check_uris(cfg, path)
    cfg.source = path.resolve() if path else None
    cfg.root = path.resolve().parent if path else (root or Path.cwd().resolve())
    cfg.found = found
    return _resolve_paths(cfg, cfg.root)
