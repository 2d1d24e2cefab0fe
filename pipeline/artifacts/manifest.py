"""`manifest.json`: what a directory the pipeline wrote holds and where it came from, as types.

Two kinds, told apart by `kind`:
- `AdapterManifest` (`kind: adapter`; manifests written before `kind` existed are adapters):
  `pipeline train` writes it into `<run>/adapter/`; `register` uploads it with the adapter;
  `publish` adds `registered_files`, `published`, `normalised`, `revalidated` in the volume's copy.
- `MergedManifest` (`kind: merged-lora`): `pipeline merge` writes it into the merged checkpoint.
  Its `adapter` is the adapter it was merged from, not LoRA settings.

Both list the sha256 of every other file in the directory (`files`), so any copy (registry
artifact, volume directory) can be verified byte for byte. A manifest is always written last and
atomically (`write_manifest`): a directory whose manifest exists is complete. `SCHEMA` is the
version of the format; fields are only ever added, and unknown fields are kept (`extra="allow"`),
so an older pipeline reads a newer manifest's known fields and the reverse. Every field but
`files` may be absent (a block reads as an empty record, a value as None): schema-1 manifests on
volumes and in registries written by earlier releases lack some of them.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
)

from pipeline.artifacts import hashing
from pipeline.artifacts.adapter import WEIGHTS_FILE
from pipeline.artifacts.atomic import write_json_atomic
from pipeline.artifacts.bounded import MIB, BoundsError, load_json_file

MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 16 * MIB
SCHEMA = 1


class _Record(BaseModel):
    """A manifest block: typed known fields, unknown ones kept."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, coerce_numbers_to_str=True)


# -- adapter manifests ------------------------------------------------------------------------------------
class BaseModelRef(_Record):
    """The base the adapter was trained on: axolotl's `base_model` (a local path or a hub id)."""

    id: str | None = None
    revision: str | None = None
    fingerprint: str | None = Field(
        None, description="pipeline.dev.tinybase base_fingerprint of a local base"
    )


class ServedRef(_Record):
    """The fleet's served checkpoint at training time (`served` in pipeline.yaml)."""

    checkpoint: str | None = None
    revision: str | None = None
    model: str | None = None


class DatasetFile(_Record):
    path: str
    role: str | None = Field(None, description="train or validation")
    sha256: str | None = None
    conversations: int | None = None


class KeptSplit(_Record):
    """What axolotl kept of one split (`pipeline.train.gate.SplitCount`): conversations (rows), tokens
    (input ids) and trainable tokens (labels != -100), before and after its filters."""

    split: str
    sequence_len: int | None = None
    conversations: int | None = None
    kept: int | None = None
    dropped: int | None = None
    tokens: int | None = None
    kept_tokens: int | None = None
    trainable_tokens: int | None = None
    kept_trainable_tokens: int | None = None


class DatasetRecord(_Record):
    fingerprint: str | None = None
    files: list[DatasetFile] = Field(default_factory=list)
    kept: list[KeptSplit] = Field(default_factory=list, description="the dataset gate's counts per split")

    def validation_files(self) -> list[Path]:
        """Paths of the files not used for training (role `validation`, or none recorded)."""
        return [Path(f.path) for f in self.files if f.role != "train"]


class TrainingInputs(_Record):
    """What determined the adapter (`pipeline.artifacts.fingerprint.training_inputs`)."""

    dataset_fingerprint: str | None = None
    config_inputs_sha256: str | None = None
    base: dict[str, Any] | None = None
    tokenizer_sha256: str | None = None
    dataset_entries_sha256: str | None = None  # which file goes with which dataset entry (None: one per list)
    fingerprint: str | None = None


class LoraSettings(_Record):
    """The adapter_config.json fields that shape the adapter (PEFT `LoraConfig` names)."""

    r: int | None = None
    lora_alpha: int | float | None = None
    target_modules: list[str] | str | None = None
    rank_pattern: dict[str, Any] | None = None
    alpha_pattern: dict[str, Any] | None = None
    use_rslora: bool | None = None
    use_dora: bool | None = None
    peft_type: str | None = None

    KEYS: ClassVar[tuple[str, ...]] = (
        "r",
        "lora_alpha",
        "target_modules",
        "rank_pattern",
        "alpha_pattern",
        "use_rslora",
        "use_dora",
    )


class TrainMetrics(_Record):
    """`pipeline.train.metrics.summarise`: losses, throughput (tokens/s), MFU (fraction), memory (GiB)."""

    train_loss: float | None = None
    eval_loss: float | None = None
    tokens_per_s: float | None = None
    trainable_tokens_per_s: float | None = None
    mfu: float | None = None
    peak_tflops: float | None = None
    peak_mem_gib: float | None = None
    train_runtime_s: float | None = None
    steps: int | None = None

    def figures(self) -> dict[str, Any]:
        """The measured figures, known and unknown, as MLflow metrics are logged."""
        return self.model_dump(exclude_none=True)


class Origin(_Record):
    """Which registry entry a volume directory came from (`pipeline.release.origin`)."""

    tracking_uri: str | None = None
    experiment_id: str | None = None
    experiment_created: int | None = None
    name: str | None = None
    version: int | None = None
    source: str | None = None
    run_id: str | None = None
    version_created: int | None = None
    weights_sha256: str | None = None


class PublishRecord(_Record):
    """What `publish` wrote into the volume's copy."""

    name: str
    version: int
    original_base_model_name_or_path: str | None = None
    base_model_name_or_path: str | None = None
    registry: Origin = Field(default_factory=Origin)
    time: str | None = None


class StrategyRecord(_Record):
    """How a multi-process run spread over its GPUs (`pipeline.train.strategy.Choice`)."""

    strategy: str
    reason: str | None = None
    ddp_per_gpu_gb: float | None = None


class RegistryRef(_Record):
    name: str
    version: int


class _Manifest(_Record):
    schema_: int = Field(SCHEMA, alias="schema", description="manifest schema version")
    created: str | None = Field(None, description="ISO 8601, UTC, seconds")
    versions: dict[str, str | None] = Field(default_factory=dict, description="package -> installed version")

    def to_json(self) -> dict:
        """The JSON object written to manifest.json: every field set, `schema` and `kind` included."""
        out = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        out["schema"] = self.schema_
        out["kind"] = self.kind  # type: ignore[attr-defined]
        return out


class AdapterManifest(_Manifest):
    """A LoRA adapter directory: training output, registry artifact, volume version directory."""

    kind: Literal["adapter"] = "adapter"
    files: dict[str, str] = Field(description="relative path -> sha256 of every other file")
    name: str | None = None
    base_model: BaseModelRef = Field(default_factory=BaseModelRef)
    served: ServedRef = Field(default_factory=ServedRef)
    dataset: DatasetRecord = Field(default_factory=DatasetRecord)
    config_sha256: str | None = Field(None, description="sha256 of the axolotl config text")
    inputs: TrainingInputs = Field(default_factory=TrainingInputs)
    resolved_config: str | None = Field(None, description="path of the resolved axolotl config of the run")
    adapter: LoraSettings = Field(default_factory=LoraSettings)
    metrics: TrainMetrics = Field(default_factory=TrainMetrics)
    mlflow_run_id: str | None = None
    gpus: int | None = None
    strategy: StrategyRecord | None = Field(
        None, description="DDP or FSDP2 and why (pipeline.train.strategy)"
    )
    # written by publish into the volume's copy
    registered_files: dict[str, str] | None = Field(None, description="`files` as registered, before publish")
    published: PublishRecord | None = None
    normalised: dict[str, Any] | None = Field(
        None, description="parity-proven rewrites (pipeline.artifacts.normalise)"
    )
    revalidated: dict[str, Any] | None = None

    @field_validator("base_model", "served", "dataset", "inputs", "adapter", "metrics", mode="before")
    @classmethod
    def _null_block(cls, v):
        return {} if v is None else v  # the schema-1 model allowed null blocks

    @property
    def weights_sha256(self) -> str:
        """sha256 of adapter_model.safetensors as listed ("" when not listed)."""
        return self.files.get(WEIGHTS_FILE, "")

    @property
    def registered_weights_sha256(self) -> str | None:
        """sha256 of the weights as registered (before publish rewrote keys), else None."""
        return (self.registered_files or {}).get(WEIGHTS_FILE)

    def registered_version(self) -> RegistryRef | None:
        """The registry version this directory was published from (`published`), else None."""
        return (
            RegistryRef(name=self.published.name, version=self.published.version) if self.published else None
        )


class MergedBase(_Record):
    path: str
    layout: str | None = Field(None, description="pipeline.artifacts.checkpoint layout: text or vl")
    fingerprint: str | None = None


class MergedFrom(_Record):
    """The adapter a merged checkpoint was folded from."""

    path: str
    name: str | None = None
    weights_sha256: str | None = None
    manifest_base_model: BaseModelRef | None = None
    registered: RegistryRef | None = None
    config: dict[str, Any] = Field(
        default_factory=dict, description="adapter_config.json fields (r, lora_alpha, ...)"
    )


class MergeStats(_Record):
    dtype: str
    lora_pairs: int
    merged_modules: int
    copied_tensors: int | None = None
    scales: dict[str, int] = Field(default_factory=dict, description="LoRA scale -> modules")
    bytes: int | None = None
    seconds: float | None = None
    device: str | None = Field(None, description="torch device the merge ran on")
    static_checks: dict[str, Any] | None = Field(
        None, description="validate's static checks run first: checked findings, rules_version"
    )


class MergeParity(_Record):
    """`pipeline.merge.parity.check_parity`'s verdict (logits, nats), or why it was skipped."""

    verdict: Literal["pass", "fail", "skipped"]
    reason: str | None = None
    max_abs_diff: float | None = None
    tolerance: float | None = None
    max_abs_logit: float | None = None
    adapter_effect: float | None = None
    greedy_equal: bool | None = None
    near_ties: int | None = None
    max_new_tokens: int | None = None
    seconds: float | None = None
    reasons: list[str] = Field(default_factory=list)
    prompts: list[dict[str, Any]] = Field(default_factory=list)


class Requantization(_Record):
    status: str = "pending"
    target: str | None = None
    keep_bf16: list[str] = Field(default_factory=list)
    recipe: str | None = None


class Quantization(_Record):
    """How a served-format merge was quantized (`pipeline.merge.quantize.quantize_checkpoint`'s record)."""

    format: str
    tool: str | None = Field(None, description="nvidia-modelopt")
    version: str | None = None
    config: str | None = Field(None, description="ModelOpt config name, e.g. NVFP4_DEFAULT_CFG")
    extra_disabled: list[str] = Field(default_factory=list, description="module patterns left unquantized")
    algorithm: Any = None
    quant_algo: str | None = None
    group_size: int | None = None
    kv_cache_quant_algo: str | None = None
    exclude_modules: list[str] = Field(default_factory=list)
    calibration: dict[str, Any] = Field(default_factory=dict, description="source, samples, tokens, sha256")
    mtp_tensors: int | None = None
    visual: str | None = None
    architecture: str | None = None
    device: str | None = None
    seconds: float | None = None
    hf_quant_config_sha256: str | None = None
    source: dict[str, Any] = Field(default_factory=dict, description="the bf16 checkpoint: path, fingerprint")


class ServedParity(_Record):
    """The engine-side gate (`pipeline merge-parity`): `pending` until measured, then its record."""

    status: str = Field("pending", description="pending, pass or fail")


class MergedManifest(_Manifest):
    """A merged checkpoint: base + adapter folded into one model (`pipeline merge`).

    bf16 (`format` None, dtype `merge.dtype`, `requantization` pending), or the served format
    (`format: nvfp4`: `quantization` says how, `served_parity` whether the engine agrees).
    """

    kind: Literal["merged-lora"] = "merged-lora"
    format: str | None = Field(None, description="nvfp4 for the served-format merge; None: merge.dtype")
    files: dict[str, str] | None = Field(None, description="relative path -> sha256; None with --no-hash")
    base: MergedBase
    adapter: MergedFrom
    merge: MergeStats
    parity: MergeParity | None = None
    requantization: Requantization | None = Field(
        None,
        validation_alias=AliasChoices("requantization", "requantisation"),  # spelling before issue 26
    )
    quantization: Quantization | None = None
    served_parity: ServedParity | None = None


def _kind(data: Any) -> str:
    if isinstance(data, BaseModel):
        return getattr(data, "kind", "adapter")
    return data.get("kind", "adapter") if isinstance(data, dict) else "adapter"


Manifest = Annotated[
    Annotated[AdapterManifest, Tag("adapter")] | Annotated[MergedManifest, Tag("merged-lora")],
    Discriminator(_kind, custom_error_type="kind", custom_error_message="unknown manifest kind"),
]
_MANIFEST = TypeAdapter(Manifest)
KINDS = ("adapter", "merged-lora")


def package_versions(names=("axolotl", "peft", "transformers", "torch", "mlflow", "lora-pipeline")) -> dict:
    """{distribution: installed version or None} for the libraries that shape an adapter."""
    out = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    return out


def file_hashes(directory: Path) -> dict[str, str]:
    """{relative path: sha256} of every regular file under `directory`, the manifest itself excluded."""
    return hashing.file_hashes(directory, exclude=(MANIFEST,))


def parse_manifest(data: Any, where: str = MANIFEST) -> AdapterManifest | MergedManifest:
    """`data` (a JSON object) as its manifest kind. Raises ValueError naming `where` and the bad fields."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be a JSON object")
    if data.get("kind", "adapter") not in KINDS:
        raise ValueError(
            f"{where}: manifest kind {data['kind']!r} is not one this pipeline reads ({', '.join(KINDS)}): "
            "written by a newer pipeline, or not a pipeline manifest"
        )
    try:
        return _MANIFEST.validate_python(data)
    except ValidationError as e:
        bad = "; ".join(f"{'.'.join(map(str, x['loc'][1:] or x['loc']))}: {x['msg']}" for x in e.errors())
        raise ValueError(f"{where}: not a pipeline manifest ({bad})") from e


def read_manifest(directory: Path) -> AdapterManifest | MergedManifest:
    """Load `<directory>/manifest.json` as its kind (`AdapterManifest` or `MergedManifest`).

    Raises FileNotFoundError (absent) or ValueError (not UTF-8 JSON, over the size or depth bounds
    of `pipeline.artifacts.bounded`, not an object, a field of the wrong type, an unknown kind),
    naming the file.
    """
    p = Path(directory) / MANIFEST
    try:
        data = load_json_file(p, MAX_MANIFEST_BYTES)
    except BoundsError:
        raise  # a ValueError naming the file and the bound
    except UnicodeDecodeError as e:
        raise ValueError(f"{p}: not a text file (byte {e.start} is not UTF-8)") from e
    except IsADirectoryError as e:
        raise ValueError(f"{p}: is a directory, not a manifest file") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from e
    return parse_manifest(data, str(p))


def read_adapter_manifest(directory: Path) -> AdapterManifest:
    """`read_manifest` for a directory that must hold an adapter. Raises as it, and ValueError for a merged one."""
    m = read_manifest(directory)
    if not isinstance(m, AdapterManifest):
        raise ValueError(
            f"{Path(directory) / MANIFEST}: a {m.kind} checkpoint's manifest, not an adapter's "
            "(a merged model is served as a base, not loaded as a LoRA adapter)"
        )
    return m


def write_manifest(directory: Path, manifest: AdapterManifest | MergedManifest) -> Path:
    """Write `<directory>/manifest.json` atomically (write it last: its presence means complete)."""
    p = Path(directory) / MANIFEST
    write_json_atomic(p, manifest.to_json())
    return p


def verify_files(directory: Path, expected: dict[str, str]) -> list[str]:
    """Problems (missing, extra, sha256 mismatch) between `directory` and `expected` hashes."""
    actual = file_hashes(directory)
    problems = [f"{directory}/{n}: missing" for n in sorted(set(expected) - set(actual))]
    problems += [f"{directory}/{n}: not in the manifest" for n in sorted(set(actual) - set(expected))]
    problems += [
        f"{directory}/{n}: sha256 {actual[n][:12]}... != manifest {expected[n][:12]}..."
        for n in sorted(set(actual) & set(expected))
        if actual[n] != expected[n]
    ]
    return problems
