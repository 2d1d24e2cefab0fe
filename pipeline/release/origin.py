"""Where a version directory came from: the registry (store identity) and the model version, checked on reuse.

`publish` writes `manifest.published.registry` = {tracking_uri (redacted), experiment_id,
experiment_created, name, version, source, run_id, version_created, weights_sha256}. `source` is
the version's artifact URI (`models:/m-<random id>`), unique to that version in that store, and
`version_created` its creation time: a registry recreated at the same URI (a deleted sqlite file,
a new database) has a new "v1" with another source, so a publish or rollback that finds a
`<NAME>-v1` directory written from the old v1 refuses it (PublishError, exit 1) instead of
serving the old weights under the new version. Directories written by older pipelines record
`source` too.
"""

from __future__ import annotations

from pipeline.artifacts.manifest import AdapterManifest, Origin
from pipeline.registry.store import store_identity


def expected_origin(cfg, mv) -> Origin:
    """The origin record for model version `mv` in the project's registry."""
    return Origin(
        **store_identity(cfg),
        name=mv.name,
        version=int(mv.version),
        source=mv.source,
        run_id=mv.run_id,
        version_created=getattr(mv, "creation_timestamp", None),
        weights_sha256=(mv.tags or {}).get("weights_sha256"),
    )


def origin_problem(manifest: AdapterManifest, expected: Origin, where: str) -> str | None:
    """Why the directory described by `manifest` is not the version `expected` describes, or None."""
    rec = manifest.published.registry if manifest.published else Origin()
    registered = manifest.registered_weights_sha256
    diffs = []
    if rec.source and expected.source and rec.source != expected.source:
        diffs.append(f"artifact {rec.source} (registry now: {expected.source})")
    vc, ec = rec.version_created, expected.version_created
    if vc is not None and ec is not None and vc != ec:
        diffs.append(f"version created at {vc} ms (registry now: {ec} ms)")
    if registered and expected.weights_sha256 and registered != expected.weights_sha256:
        diffs.append(f"weights sha256 {registered[:12]}... (registry now: {expected.weights_sha256[:12]}...)")
    if not diffs:
        return None
    return (
        f"{where} was published from another registry entry than {expected.name} v{expected.version} "
        f"in {expected.tracking_uri}: " + "; ".join(diffs) + ". The registry was recreated or the model "
        "re-registered, so the number now names other weights. Nothing was changed: move the directory away "
        "(it is the old version's weights), then publish again"
    )
