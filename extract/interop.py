"""`layertap export` and `layertap import`: a run's samples to and from the public trainers'
per-sample layouts (storage/foreign*.py).

Export reads the run's committed shards in shard order (every record's hash checked) and writes
one foreign file per sample; the layers keep their order, except for speculators, whose files
hold them ascending. A format that carries a final state needs the run to hold that very state:
speculators the last layer's pre-norm output, ModelOpt its post-norm one. An export that fails
removes the files it wrote (the foreign trainers would train on an export cut short).

Import makes an ordinary run: a manifest planned over the source's files, then shards claimed,
written and committed through the same leases and commit records as an extraction, so a second
`layertap import` with the same arguments resumes it (committed shards are skipped) and a
different one is refused with the differences. A file that cannot be read as the format says,
or holds a sample training cannot learn from (`check_trainable`), is skipped with
its reason in the shard's commit, as extraction skips a bad row. `--layers` are checked against
the target's layer count by extraction's own check before anything is written.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import xxhash

from layertap.extract.config import check_layers, text_config
from layertap.extract.console import progress
from layertap.extract.estimate import planned_bytes_per_token
from layertap.extract.inputs import NO_SUPERVISED_PAIR
from layertap.manifests import layout
from layertap.manifests.commit_index import read_commits
from layertap.manifests.manifest import (DEFAULT_SHARD_BYTES, Manifest, create_or_resume, header_mismatch,
                                         load_manifest)
from layertap.manifests.preemption import Preempted, StopSignals
from layertap.manifests.records import Producer
from layertap.manifests.status import still_committed
from layertap.manifests.work import Claim, WorkQueue
from layertap.storage.errors import ConfigError, InputError, MissingInput, UserError
from layertap.storage.foreign import (FINAL_STATE, LAYER_OFFSET, PROBE_FILES, ForeignFile, ForeignReader,
                                      ForeignWriter, foreign_layers, layer_order, printable, reader,
                                      unservable_layer, writer)
from layertap.storage.format import ShardError, ShardMeta, UnsupportedShard
from layertap.storage.identity import RunConfig
from layertap.storage.reader import ShardReader, object_xxh3_128
from layertap.storage.records import Sample
from layertap.storage.store import ObjectNotFound, ObjectStore, TransientStoreError, is_write_probe
from layertap.storage.units import counted, listing, possessive
from layertap.storage.writer import ShardWriter

log = logging.getLogger(__name__)

EXPORT_NOTE = layout.EXPORT_NOTE  # beside the foreign files: where they came from, layer ids in both conventions


def layertap_layers(fmt: str, layers: list[int]) -> list[int]:
    """`fmt`'s layer ids as layertap's (the output of decoder layer k)."""
    out = [k - LAYER_OFFSET[fmt] for k in layers]
    if any(k < 0 for k in out):
        raise ConfigError(f"--layers {','.join(map(str, layers))}: {fmt} counts layers from {LAYER_OFFSET[fmt]} "
                          f"(its id {LAYER_OFFSET[fmt]} is the first decoder layer's output)")
    return out


def check_exportable(fmt: str, run: RunConfig, uri: str) -> None:
    need = FINAL_STATE[fmt]
    if need != "none" and run.final_state != need:
        what = {"prenorm": "the last decoder layer's output before the final norm",
                "postnorm": "the last layer's state after the final norm"}[need]
        raise ConfigError(f"{possessive(fmt)} files hold {what} beside the capture layers, but the run at {uri} stored "
                          f"final_state={run.final_state!r}: extract the run with --final-state {need} to export it "
                          f"to {fmt}")


def export_run(run: ObjectStore, fmt: str, dest: ObjectStore, limit: int | None = None,
               rows_only: bool = False) -> dict[str, Any]:
    """Write the run's committed samples (the first `limit`) to `dest` in `fmt`'s layout
    (`rows_only`: speculators' Arrow dataset alone, its states read from the run by
    `extract.speculators_transfer`)."""
    manifest = load_manifest(run)
    ident = manifest.identity
    check_exportable(fmt, ident, run.uri)
    check_empty(dest)
    commits = read_commits(run).records
    if len(commits) < len(manifest.shards):
        log.warning("the run at %s has %d of %d shards committed: exporting those", run.uri, len(commits),
                    len(manifest.shards))
    order = layer_order(fmt, ident.layers)
    layers = [ident.layers[j] for j in order]
    total = sum(c.num_records for c in commits)
    total = min(total, limit) if limit is not None else total
    out, written_note = writer(fmt, dest, rows_only=rows_only), False
    try:
        written, sources, gone = _write_samples(run, commits, fmt, order, total, out, manifest.config)
        if written == 0:  # speculators' dataset of no file does not even load; SpecForge's folder holds nothing
            raise InputError(f"the run at {run.uri} has no sample to export: "
                             + ("no shard is committed yet" if not commits else
                                "the data of every committed shard is gone (consumed by a --delete-consumed trainer, "
                                "or withdrawn by `layertap verify`)"))
        note = {"format": fmt, "source": run.uri, "run_id": manifest.run_id, "model": ident.model,
                **({"gguf_file": ident.gguf_file} if ident.gguf_file else {}), "samples": written,
                "layers": layers, f"{fmt}_layer_ids": foreign_layers(fmt, layers), "final_state": FINAL_STATE[fmt],
                "hidden_size": ident.hidden_size, "rows_only": rows_only, "sources": sources,
                # the run's shards not in it: not committed, or their data gone (consumed, withdrawn)
                "shards_planned": len(manifest.shards), "shards_missing": len(manifest.shards) - len(commits) + gone}
        written_note = True  # tried: a put whose answer was lost may have landed
        dest.put(EXPORT_NOTE, (json.dumps(note, indent=1) + "\n").encode())
    except BaseException as e:
        _remove_partial_export(dest, out.written() + ([EXPORT_NOTE] if written_note else []), e)
        raise
    return note


def _write_samples(run: ObjectStore, commits: list, fmt: str, order: list[int], total: int,
                   out: ForeignWriter, config: dict[str, Any]) -> tuple[int, list[dict[str, Any]], int]:
    """Write the first `total` committed samples in shard order; how many, the shards read, and how
    many committed shards' data was gone.
    Each shard's HEAD must say the states the manifest's `config` does (`header_mismatch`): the
    files and their note are labelled by the manifest, and an edited one mislabelled them."""
    written = gone = 0
    sources: list[dict[str, Any]] = []  # the rows' shards in order: row i is the i-th of their samples
    with progress(total, desc="export", unit="sample") as bar:
        for c in commits:
            if written >= total:
                break
            try:
                records = ShardReader(run, c.data_key)
            except UnsupportedShard as e:  # newer, or its version or codec field damaged: its commit's hash tells
                if object_xxh3_128(run, c.data_key) == c.xxh3_128:
                    raise
                raise ShardError(f"{e}; but the object's hash differs from its commit's: it is corrupt, not newer. "
                                 f"Run `layertap verify {run.uri}` (it withdraws it), then `layertap extract` again "
                                 "to redo it") from None
            except ObjectNotFound:  # consumed by a --delete-consumed trainer, or withdrawn (and redone) since listed
                if not run.exists(layout.consumed_marker_key(c.shard)) and still_committed(run, c.shard, c.data_key):
                    raise InputError(  # lost: an export without it would pass for the whole run
                        f"committed shard {c.shard}'s data ({run.uri.rstrip('/')}/{c.data_key}) is missing, and no "
                        f"trainer consumed it: run `layertap verify {run.uri}` (it withdraws the shard), then "
                        "`layertap extract` again to redo it, and export again") from None
                log.warning("shard %d's data (%s) is gone: its %d samples are not exported", c.shard, c.data_key,
                            c.num_records)
                gone += 1
                continue
            if (refused := header_mismatch(run.uri, c.shard, c.data_key, records.meta, config)) is not None:
                raise refused
            sources.append({"shard": c.shard, "data_key": c.data_key, "samples": 0})
            for sample in records:
                if written >= total:
                    break
                states = sample.hidden_states[:, order] if order != list(range(len(order))) else sample.hidden_states
                final = sample.final_state if FINAL_STATE[fmt] != "none" else None
                out.write(written, replace(sample, hidden_states=states, final_state=final))
                written += 1
                sources[-1]["samples"] += 1
                bar.update(1)
    out.close()
    return written, sources, gone


class ExportFailed(UserError):
    """An export that failed on a user-fixable cause (a corrupt shard, a store error), its partial
    output removed; the message says so."""


class ExportCutOff(ExportFailed, TransientStoreError):
    """An export that failed on a store past its retries: exits 5, as every command does then."""


def _remove_partial_export(dest: ObjectStore, keys: list[str], error: BaseException) -> None:
    """Remove what a failed export wrote: the foreign trainers read every sample file under DEST
    and the export note is written last, so the files of an export cut short would be trained on
    as if complete, and they keep DEST from being exported into again. Raises `ExportFailed`
    (from a `UserError`), or adds a note to `error` (a bug, Ctrl-C: the traceback stays), saying
    whether DEST was cleaned, or which files to remove by hand: those one listing finds, or all it
    wrote (asking a failing store about each file in turn took minutes of retries)."""
    try:
        dest.delete_many(keys)
        for folder in sorted({k.split("/", 1)[0] + "/" for k in keys if "/" in k}):  # hidden_states/, rows_0-2000/
            dest.remove_empty_folders(folder)
        left, why = [], ""
    except Exception as e:  # noqa: BLE001 - any store failure: name the files instead
        why = f"{type(e).__name__}: {e}"
        try:
            there = {o.key for o in dest.list("")}
            left = [k for k in keys if k in there]
        except Exception:  # noqa: BLE001 - the store is failing: any of them may be there
            left = keys
    if not left:
        done = (f"the export to {dest.uri} failed, and the {len(keys)} file(s) it had written were removed: no file "
                "of it is left there, so the same command can be run again once the cause is fixed")
    else:
        shown = listing(left, 20)
        done = (f"the export to {dest.uri} failed, and removing what it wrote failed too ({why}): remove {shown} "
                "(DEST was empty before this export, so everything under it) before exporting there again: the "
                "foreign trainers would train on these files of an export cut short")
    if isinstance(error, UserError):
        raise (ExportCutOff if isinstance(error, TransientStoreError) else ExportFailed)(f"{error}; {done}") from error
    error.add_note(done)
    log.error(done)


def check_empty(dest: ObjectStore) -> None:
    """Refuse a destination that holds anything: the foreign trainers glob every sample file under
    it, so files of an earlier export (a larger one, another run's, one cut short) would be trained
    on beside this one's, whatever layertap-export.json says."""
    there = next((o for o in dest.list("") if not is_write_probe(o.key)), None)
    if there is not None and dest.exists(layout.MANIFEST):  # "empty this one first" would have deleted a run
        raise ConfigError(f"the export destination {dest.uri} is a layertap run (it holds {layout.MANIFEST}): export "
                          "into a new folder or prefix of its own")
    if there is not None:
        earlier = dest.exists(EXPORT_NOTE)
        raise ConfigError(f"the export destination {dest.uri} is not empty (it holds "
                          + (f"an earlier export: {EXPORT_NOTE}" if earlier else there.key) + ", and maybe more): "
                          "the foreign trainers read every sample file under it, so an earlier export's would mix "
                          "with this one's. Export into a new folder or prefix, or empty this one first"
                          + (f" (`layertap delete {dest.uri}`)" if earlier else ""))


def _fingerprint(fmt: str, files: list[ForeignFile]) -> str:
    h = xxhash.xxh3_64()
    for f in files:
        h.update(f"{f.key}\t{f.size}\n".encode("utf-8", "surrogateescape"))  # a name not in UTF-8 too
    return f"import:{fmt}:{len(files)}:{h.hexdigest()}"


# Why an imported sample was skipped: the code in its shard's commit record, beside extraction's
# own (extract/inputs.py), whose `no_supervised_pair` it shares.
UNREADABLE = "unreadable"
BAD_TOKEN_ID = "bad_token_id"
NON_FINITE = "non_finite"
BAD_LOSS_MASK = "bad_loss_mask"


class BadSample(InputError):
    """A sample that reads as its layout says but cannot be trained on; `reason` is its skip code."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _first(bad: torch.Tensor) -> int:
    """The first token (index along dim 0) where `bad` holds anywhere."""
    return int(bad.reshape(bad.shape[0], -1).any(dim=1).nonzero()[0])


def check_trainable(sample: Sample, vocab_size: int, where: str) -> Sample:
    """Refuse (`BadSample`) what extraction refuses in pre-tokenized rows (extract/inputs.py), as
    `layertap train` would only fail on it later: a token id outside the target's vocabulary (an
    IndexError in the embedding lookup), a NaN or infinite state (NaN losses from then on), a
    loss mask of other values than 0 and 1, no two consecutive supervised tokens (nothing for a
    drafter to learn). One vectorized pass over each tensor."""
    ids = sample.input_ids
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        pos = _first(bad)
        raise BadSample(BAD_TOKEN_ID, f"{where}: token id {int(ids[pos])} at position {pos} is outside the target's "
                                      f"vocabulary [0, {vocab_size}): were these states made with another model? "
                                      "Import them with the --model they were made with")
    for name, x in (("hidden states", sample.hidden_states), ("final state", sample.final_state)):
        if x is not None and not bool(torch.isfinite(x).all()):
            bad = ~torch.isfinite(x)
            raise BadSample(NON_FINITE, f"{where}: {int(bad.sum())} NaN or infinite value(s) in its {name}, the "
                                        f"first at token {_first(bad)}: training on them would make the loss NaN")
    mask = sample.loss_mask
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        pos = _first(bad)
        raise BadSample(BAD_LOSS_MASK, f"{where}: loss_mask holds {mask[pos].item()} at position {pos}; it must hold "
                                       "only 0 and 1 (1: the token is trained on)")
    supervised = mask.bool()
    if not bool((supervised[:-1] & supervised[1:]).any()):
        raise BadSample(NO_SUPERVISED_PAIR, f"{where}: no two consecutive supervised tokens (loss_mask has "
                                            f"{int(supervised.sum())} of {supervised.numel()} tokens set): nothing "
                                            "for a drafter to learn from")
    return sample


def _token_counts(files: list[ForeignFile], probe: ForeignFile, probe_tokens: int, values_per_token: int) -> list[int]:
    """Each file's tokens for the plan: exact where the layout lists them, else estimated from
    its size at the tokens per byte of the file the plan read (`probe`; opening every file twice
    would double the I/O). One of no tokens gives no rate (every file was planned as one token: one giant shard):
    then a token is taken for its capture values at 2 bytes each, the most tokens a file can hold.
    At least 1 each: a count of 0 plans the row as one the import skips (`plan_shards`), and its
    commit may then hold no record of it, but a listed count is not what the import reads (a
    speculators `seq_len` of 0 beside token ids it imports)."""
    per_byte = probe_tokens / probe.size if probe_tokens and probe.size else 1 / (2 * max(values_per_token, 1))
    return [max(1, f.num_tokens if f.num_tokens is not None else round(f.size * per_byte)) for f in files]


def _probe(rd: ForeignReader, files: list[ForeignFile], src: ObjectStore,
           check: Callable[[tuple, str], None]) -> tuple[ForeignFile, tuple, Sample]:
    """The first file that reads of the first PROBE_FILES, its capture values and its sample: `check`
    judges the arguments by the capture values (and raises what refuses them) before it is read. A
    first file cut short or damaged refused the whole import, every other file sound; none reading,
    the first one's error is raised."""
    errors: list[tuple[ForeignFile, InputError]] = []
    for f in files[:PROBE_FILES]:
        where = f"{src.uri.rstrip('/')}/{printable(f.key)}"
        try:
            values = rd.capture_values(f)
        except InputError as e:
            errors.append((f, e))
            continue
        except ObjectNotFound:  # deleted since the listing: skipped by the import too
            errors.append((f, InputError(f"{where} is missing: deleted since it was listed")))
            continue
        check(values, where)  # the arguments against a file that reads: refused, for every file
        kind = getattr(rd, "final_state", None)  # a ModelOpt read takes the run's from the first file it reads
        try:
            sample = rd.read(f)
        except (InputError, ObjectNotFound) as e:
            errors.append((f, e if isinstance(e, InputError) else InputError(f"{where} is missing")))
            rd.final_state = kind  # not decided by a file that failed
            continue
        if errors:
            log.warning("%s of %s do not read (%s: %s): the plan checks the arguments against %s, and the import "
                        "skips them as unreadable", counted(len(errors), "file"), src.uri, printable(errors[0][0].key),
                        errors[0][1], printable(f.key))
        return f, values, sample
    raise errors[0][1]


def plan_import(src: ObjectStore, fmt: str, out: ObjectStore, *, layers: list[int], model: str, codec: str,
                gguf_file: str | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES, limit: int | None = None,
                final_state: str | None = None) -> tuple[Manifest, ForeignReader, list[ForeignFile], Target]:
    """The import's run at `out` (planned now, or the one there if it is this import), the
    source's reader and files, and the target. Every check runs before `out` is written to."""
    ours = layertap_layers(fmt, layers)
    check_layer_order(fmt, layers)
    target = read_target(model, gguf_file)
    # recorded as `extract` records a local folder: `train` from another working directory (a job's)
    # found no 'models/x', and a resume naming it another way was refused as another model; the packaged
    # SmolLM2 by its id, as `extract` records it
    from layertap.extract.embedded import embedded_id

    model = embedded_id(model, gguf_file) or os.path.realpath(model)
    facts_from = f"{model}'s {target.source}"
    rd = reader(fmt, src, len(layers), final_state)
    files = rd.files()[:limit] if limit is not None else rd.files()
    if not files:
        raise InputError(f"no samples in the {fmt} data at {src.uri}")
    note = export_note(src, fmt)
    if note is not None and note.get("rows_only") is True:  # the states were never written: hs_0 is "missing"
        raise InputError(f"{src.uri} is a `layertap export --rows-only` of the run at {note.get('source')}: it holds "
                         "the rows alone (speculators reads their states from that run), so there is nothing to "
                         "import; use that run itself (`layertap train --data` it, or export it without --rows-only)")
    _warn_of_another_model(note, model, src)
    probe, values, first = _probe(rd, files, src, lambda values, where: check_layer_count(
        values, fmt, layers, target.hidden_size, facts_from, where, note, src.uri))
    where = f"{src.uri.rstrip('/')}/{printable(probe.key)}"
    check_target_layers(fmt, layers, ours, target.num_layers, facts_from)
    try:
        check_trainable(first, target.vocab_size, where)
    except BadSample as e:  # another model's tokens: every sample would be skipped, the run empty
        if e.reason == BAD_TOKEN_ID:
            raise BadSample(e.reason, f"{e} (the file the plan reads first: its checks stand for every file's)"
                            ) from None
    identity = RunConfig(model=model, gguf_file=gguf_file, layers=ours, final_state=rd.final_state,
                         hidden_size=target.hidden_size, codec=codec)
    counts = _token_counts(files, probe, first.num_tokens, values[0])
    manifest, created = create_or_resume(
        out, config=identity, dataset={"fingerprint": _fingerprint(fmt, files), "path": src.uri, "format": fmt},
        token_counts=counts, shard_bytes=shard_bytes,
        bytes_per_token=planned_bytes_per_token(capture_layers=len(ours), hidden_size=identity.hidden_size,
                                                final_state=rd.final_state != "none", codec=codec))
    log.info("%s run %s at %s: %s from %s in %s", "planned" if created else "resuming", manifest.run_id, out.uri,
             counted(len(files), "sample"), src.uri, counted(len(manifest.shards), "shard"))
    if ours != layers:  # ids given in the files' convention: said, so that a mistake in it shows
        log.info("capture layers %s (%s ids, as --layers names them) are layertap's %s", layers, possessive(fmt), ours)
    return manifest, rd, files, target


def check_layer_order(fmt: str, layers: list[int]) -> None:
    """Refuse --layers out of ascending order: every format's files hold the capture layers
    ascending (`layer_order`), so --layers 4,2 would record layer 4 for the states of layer 2 and
    the other way round, without an error anywhere later."""
    if len(set(layers)) != len(layers):  # said here, without the target's config.json, which plays no part
        raise ConfigError(f"--layers {','.join(map(str, layers))}: capture layers repeat")
    if any(a > b for a, b in zip(layers, layers[1:])):
        raise ConfigError(f"--layers {','.join(map(str, layers))}: {possessive(fmt)} files hold the capture layers in "
                          f"ascending order (as vLLM and SGLang gather them, and ModelOpt's dumpers sort them), so "
                          f"--from {fmt} takes them ascending: pass --layers {','.join(map(str, sorted(layers)))}")


@dataclass(frozen=True, slots=True)
class Target:
    """What import checks the source against: the states' width (`hidden_size`), the layer ids
    (`num_layers`) and the token ids (`vocab_size`, the embedding's rows `layertap train` looks
    them up in); `source`: the file they were read from."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    source: str


def check_target_layers(fmt: str, layers: list[int], ours: list[int], num_layers: int, source: str) -> None:
    """Refuse capture layers the target does not have, or repeated, with extraction's own check
    and words (extract/model.py); warn, as extraction does, of the last layer, which no server
    gathers for a drafter."""
    try:
        check_layers(ours, num_layers)
    except ConfigError as e:
        ids = f" ({possessive(fmt)} ids; layertap's {','.join(map(str, ours))})" if ours != layers else ""
        raise ConfigError(f"--layers {','.join(map(str, layers))}{ids}: {e}, per {source}") from None
    remedy = (f"these files hold it, so for a servable drafter capture again (`layertap extract`) with layers below "
              f"{num_layers - 1}")
    if (why := unservable_layer(ours, num_layers, remedy)) is not None:
        log.warning(why)


def read_target(model: str, gguf_file: str | None) -> Target:
    """The facts of the target at `model` (a local folder; `gguf_file` inside it). The manifest
    records this folder and the `layertap train` that import prints as the next step reads the
    target's embeddings from it (train/target_head.py), so a folder train cannot read is refused
    now, before any work, not after the import."""
    from layertap.extract.model import refuse_gguf_as_folder

    refuse_gguf_as_folder(model)
    if not os.path.isdir(model):
        raise MissingInput(f"--model {model!r} is not a folder on this machine: import records the target's local "
                           "folder, where it reads the hidden size and `layertap train` the embeddings (a hub model: "
                           "download it first, e.g. `hf download ORG/NAME --local-dir DIR`, and pass DIR)")
    if gguf_file:
        path = os.path.join(model, gguf_file)
        if not os.path.isfile(path):
            raise MissingInput(f"GGUF file {gguf_file!r} (--gguf-file) not found in {model!r}")
        return gguf_target(path, gguf_file)
    if not os.path.isfile(os.path.join(model, "config.json")):
        ggufs = sorted(n for n in os.listdir(model) if n.endswith(".gguf"))
        raise MissingInput(f"the target folder {model!r} (--model) has no config.json, which `layertap train` needs "
                           "with the target's safetensors weights" +
                           (f"; it holds {', '.join(ggufs)}: pass --gguf-file {ggufs[0]}" if ggufs else ""))
    if not any(os.path.isfile(os.path.join(model, n)) for n in ("model.safetensors", "model.safetensors.index.json")):
        raise MissingInput(f"the target folder {model!r} (--model) has neither model.safetensors nor "
                           "model.safetensors.index.json: `layertap train` reads the target's embeddings from a "
                           "safetensors checkpoint, or a GGUF one (--gguf-file)")
    try:
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
        text = text_config(config)
        facts = {k: text.get(k, config.get(k)) for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
    except (ValueError, AttributeError) as e:
        raise InputError(f"{model}/config.json is not a model config: {e}") from None
    bad = [k for k, v in facts.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1]
    if bad:
        raise InputError(f"{model}/config.json has no {' nor '.join(bad)} (nor in its text_config)")
    return Target(facts["hidden_size"], facts["num_hidden_layers"], facts["vocab_size"], "config.json")


def gguf_target(path: str, name: str) -> Target:
    """A GGUF checkpoint's facts: `{architecture}.embedding_length` and `.block_count` in its
    metadata, and the rows of `token_embd.weight` (GGUF lists its shape as [hidden, vocab])."""
    from gguf import GGUFReader

    try:
        gg = GGUFReader(path)
        arch = gg.fields["general.architecture"].contents()
        embed = next(t for t in gg.tensors if t.name == "token_embd.weight")
        return Target(int(gg.fields[f"{arch}.embedding_length"].contents()),
                      int(gg.fields[f"{arch}.block_count"].contents()), int(embed.shape[1]), name)
    except (KeyError, ValueError, TypeError, OSError, StopIteration, IndexError) as e:
        raise InputError(f"{path}: not a GGUF checkpoint with general.architecture, its embedding_length and "
                         f"block_count, and a token_embd.weight tensor ({type(e).__name__}: {e})") from None


def export_note(src: ObjectStore, fmt: str | None) -> dict[str, Any] | None:
    """The `layertap-export.json` that `layertap export` wrote beside the files, when it is there
    and is of this layout (`fmt`; None: any): it records the layers the files hold and their hidden size."""
    try:
        note = json.loads(src.get(EXPORT_NOTE))
    except (ObjectNotFound, ValueError, RecursionError):
        return None
    return note if isinstance(note, dict) and (fmt is None or note.get("format") == fmt) else None


def _warn_of_another_model(note: dict[str, Any] | None, model: str, src: ObjectStore) -> None:
    """Warn where --model is not the model the export note records its run was extracted with: only
    the width was compared, so a model of the same width imported without a word, and the drafter
    trained on the run would borrow its embeddings and head. A warning: a copy of the model
    elsewhere is the same model."""
    made = note.get("model") if note else None
    if not isinstance(made, str) or not made:
        return
    made_here = os.path.realpath(made) if os.path.exists(made) else made
    if made_here != model:
        log.warning("%s/%s records that these states are of %s, but --model is %s: if it is not a copy of that "
                    "model, import again with --model %s (a drafter trained on the run borrows --model's "
                    "embeddings and head)", src.uri.rstrip("/"), EXPORT_NOTE, made, model, made)


def check_layer_count(values: tuple[int, int | None], fmt: str, layers: list[int], hidden: int, hidden_from: str,
                      where: str, note: dict[str, Any] | None, src_uri: str) -> None:
    """Refuse `--layers` of another count than the files hold. SpecForge and ModelOpt concatenate
    the layers, so a wrong count would split every token's values into states of another width:
    imported without a word, and only `layertap train` would notice, blaming the target. The
    target's hidden size (`hidden`, from `hidden_from`) says how many layers the files hold; the
    export note at `src_uri`, where there is one, says which. `where`: the file whose values were counted."""
    total, stored = values
    note_at = f"{src_uri.rstrip('/')}/{EXPORT_NOTE}"
    given = ",".join(map(str, layers))
    recorded = note.get(f"{fmt}_layer_ids") if note else None
    if recorded is not None and not (type(recorded) is list and all(type(i) is int for i in recorded)):
        raise InputError(f"{note_at} is corrupt: its {fmt}_layer_ids is {recorded!r:.80}, not a "
                         "list of layer ids; remove it (or restore it) and give --layers")
    seen = f"; {EXPORT_NOTE} beside them records {possessive(fmt)} layer ids {recorded}" if recorded else ""
    if note is not None and note.get("hidden_size") not in (None, hidden):
        raise InputError(f"{note_at} says its states are {note['hidden_size']} wide (a run of "
                         f"{note.get('model')}), but the target's hidden size is {hidden} (from {hidden_from}): pass "
                         "the target they came from as --model")
    width = total // stored if stored else hidden
    if width != hidden or total % hidden:
        what = (f" ({stored} layer(s) of {width}): states {width} wide, where the target's hidden size is {hidden}"
                if stored and width != hidden else
                f", which is not a whole number of states of the target's hidden size {hidden}")
        raise InputError(f"{where} holds {total:,} values per token of capture-layer states{what} (from "
                         f"{hidden_from}): are these states of --model's model?{seen}")
    held = total // hidden
    if held != len(layers):
        # a wrong --model reads as a wrong count too (576-wide states of 3 layers, a 64-wide target: "27 layers")
        other = (f"; or, if --layers is right, they are states {total // len(layers):,} wide: another model's than "
                 "--model's, so pass the target they came from as --model" if total % len(layers) == 0 else "")
        raise InputError(f"{where} holds {total:,} values per token of capture-layer states; at the target's hidden "
                         f"size {hidden} (from {hidden_from}) that is {held} capture layer(s), but --layers {given} "
                         f"names {len(layers)}: give --layers the {held} ids the files hold, in their order{seen}"
                         f"{other}")
    if recorded is not None and list(recorded) != list(layers):
        raise InputError(f"--layers {given}, but {note_at} records that the files hold {possessive(fmt)} "
                         f"layer ids {recorded} (layertap's {note.get('layers')}): pass --layers "
                         f"{','.join(map(str, recorded))}")


def import_run(src: ObjectStore, fmt: str, out: ObjectStore, **options: Any) -> Manifest:
    """Import the source into a run at `out`, shard by shard, until every shard is committed
    (or left failed: `layertap status` says why)."""
    manifest, rd, files, target = plan_import(src, fmt, out, **options)
    queue = WorkQueue(out, manifest, Producer.current(0))
    if queue.finished():
        log.info("nothing to do: every shard of the run at %s is committed", out.uri)
        return manifest
    renamed = rd.renamed  # the plan read the first file
    told: dict[str, int] = {}  # files skipped, by reason
    # A stop ends a wait for work at once, but never breaks into a shard's work (its writer's threads,
    # the commit, the lease's release: see StopSignals.deferred): it is taken at the next file.
    # a resumed import's bar starts at the files of its committed shards (one listing of the commits)
    done = {layout.shard_of(o.key, layout.COMMITS) for o in out.list(layout.COMMITS)}
    initial = sum(p.end - p.start for p in manifest.shards if p.id in done)
    with StopSignals(at_once=True) as stops, progress(len(files), initial=initial, desc="import",
                                                      unit="sample") as bar:
        for claim in queue:
            try:
                with stops.deferred(), claim:
                    _import_shard(claim, manifest, rd, files, fmt, src.uri, target.vocab_size, bar, told,
                                  stops.raise_if_requested)
            except Preempted:
                claim.release()
                raise
            except Exception as e:  # recorded by the claim; go on with the next shard
                if not claim.superseded:  # else another attempt's commit counts it
                    log.error("shard %d failed: %s: %s", claim.shard, type(e).__name__, e)
    if (unshown := sum(told.values()) - sum(min(n, SKIPS_SHOWN) for n in told.values())) > 0:
        log.warning("%d more file(s) skipped than shown above (%d a reason at most): `layertap status %s` counts them "
                    "by reason, and their commit records name each", unshown, SKIPS_SHOWN, out.uri)
    if rd.renamed > renamed:
        log.warning("%d sample(s) imported now have their file's name for id, not the id inside the file, which "
                    "is not their file's name or is another file's (a run's sample ids are unique)",
                    rd.renamed - renamed)
    return manifest


SKIPS_SHOWN = 5  # skipped files warned of, a reason at most (a run of bad files logged a line each)


def _read(rd: ForeignReader, f: ForeignFile, where: str, again: bool) -> Sample:
    """`rd.read(f)`; with `again` (a file on S3), a file that does not read is read once more before it
    is skipped: a read damaged on its way (a zip CRC error in a .ckpt, a multipart object no ETag
    checks) left the sample out for good, as the run's shard was committed. A file gone since the plan
    (deleted meanwhile) is a skipped one, not a failed shard: it failed every retry, and the run then
    refused the same command (its files' fingerprint had changed)."""
    try:
        try:
            return rd.read(f)
        except InputError as e:
            if not again or isinstance(e, BadSample):
                raise
            log.info("%s did not read (%s): reading it again, in case it was damaged on its way", where, e)
            return rd.read(f)
    except ObjectNotFound:
        raise InputError(f"{where} is missing: deleted since the import was planned") from None


def _import_shard(claim: Claim, manifest: Manifest, rd: ForeignReader, files: list[ForeignFile], fmt: str,
                  source: str, vocab_size: int, bar, told: dict[str, int],
                  check_stop: Callable[[], None] = lambda: None) -> None:
    """Write and commit one shard of the import; `told` counts the files skipped by reason (the first
    SKIPS_SHOWN of each are warned of); `check_stop` raises a stop asked for meanwhile, before each
    file (the shard is then aborted, nothing of it visible)."""
    plan = claim.plan
    meta = ShardMeta.of(manifest.identity, run_id=manifest.run_id, shard_id=plan.id,
                        extra={"imported_from": fmt, "source": source})
    skipped: list[dict[str, str]] = []
    read = 0  # files counted on the bar, taken back if the shard fails (its retry counts them again)
    try:
        with ShardWriter(claim.queue.store.open_writer(claim.data_key), meta) as w:
            for f in files[plan.start:plan.end]:
                check_stop()
                where = f"{source.rstrip('/')}/{printable(f.key)}"
                try:
                    w.write_sample(check_trainable(_read(rd, f, where, again=source.startswith("s3://")), vocab_size,
                                                   where))
                except (InputError, ValueError) as e:  # a bad file, of another shape than the run's, or untrainable
                    reason = e.reason if isinstance(e, BadSample) else UNREADABLE
                    skipped.append({"sample_id": f.sample_id, "reason": reason, "detail": str(e)[:500]})
                    told[reason] = told.get(reason, 0) + 1
                    log.log(logging.WARNING if told[reason] <= SKIPS_SHOWN else logging.DEBUG, "skipped %s: %s",
                            printable(f.key), e)
                bar.update(1)
                read += 1
            info = w.close()
        committed = claim.commit(info, skipped=skipped)
    except BaseException:
        bar.update(-read)
        raise
    if committed:
        log.info("shard %d committed: %s, %s (%d skipped)", plan.id, counted(info.num_records, "sample"),
                 counted(info.num_tokens, "token"), len(skipped))
