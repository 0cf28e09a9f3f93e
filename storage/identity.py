"""What a run's stored states are: one typed record shared by the manifest, every shard's HEAD
frame and the readers.

`RunIdentity` holds the facts a reader needs to interpret the states (model, layers and their
convention, final state, width, codec, tokenizer). The HEAD's `ShardMeta` (storage/format.py) is a
`RunIdentity` plus the shard's own fields; the manifest's `config` is a `RunConfig`: the identity
plus the extraction settings that also shape the bytes (GGUF file, forward dtype, max length).
Both write and read the same JSON keys they always have (docs/FORMAT.md §3, `manifest.json`), the
manifest's content hashes aside: they are newer, and runs without them still resume (`IF_RECORDED`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from layertap.storage.codec_names import CODEC_NAMES

# Layer k is the output of decoder layer k: HF `outputs.hidden_states[k + 1]`, except that HF's
# last entry is taken after the final norm (this format's "postnorm" final state). vLLM and SGLang
# count the same tensor as layer k + 1. The only value, written into every HEAD and manifest.
LAYER_CONVENTION = "decoder_output"
FinalState = Literal["none", "prenorm", "postnorm"]
FINAL_STATES: tuple[str, ...] = ("none", "prenorm", "postnorm")


@dataclass(frozen=True, kw_only=True)
class RunIdentity:
    """The facts that determine what a run's stored states mean; a rerun must match them."""

    model: str
    model_revision: str | None = None
    tokenizer: str | None = None
    layers: list[int]  # in the order of axis 1 of `hidden_states`
    layer_convention: str = LAYER_CONVENTION
    final_state: FinalState = "none"
    hidden_size: int | None = None  # required in a HEAD; a synthetic run's manifest may lack it
    codec: str

    def __post_init__(self) -> None:
        if type(self.model) is not str or not all(v is None or type(v) is str
                                                  for v in (self.model_revision, self.tokenizer)):
            raise ValueError(f"model, model_revision and tokenizer must be strings (the last two may be null), got "
                             f"{self.model!r:.80}, {self.model_revision!r:.80}, {self.tokenizer!r:.80}")
        if self.codec not in CODEC_NAMES:
            raise ValueError(f"unknown codec {self.codec!r}; valid codecs: {', '.join(CODEC_NAMES)}")
        if not self.layers or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in self.layers):
            raise ValueError(f"layers must be a non-empty list of non-negative ints, got {self.layers!r}")
        object.__setattr__(self, "layers", list(self.layers))  # our own copy: the caller's list may change
        if self.final_state not in FINAL_STATES:
            raise ValueError(f"final_state must be one of {FINAL_STATES}, got {self.final_state!r}")
        if self.hidden_size is not None and (type(self.hidden_size) is not int or self.hidden_size <= 0):
            raise ValueError(f"hidden_size must be positive, got {self.hidden_size}")

    def to_json(self) -> dict[str, Any]:
        """Every field under its own name."""
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]):
        """The fields named in `obj`; keys this class does not have are ignored (a HEAD's run and
        shard ids, a test's extra settings). ValueError or TypeError if a fact is missing or bad."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in obj.items() if k in names})


# What the stored states are, as a reader shapes and interprets them: a shard's HEAD must agree with its manifest here.
STATE_FIELDS = ("layers", "layer_convention", "final_state", "hidden_size", "codec")


def header_disagreement(header: RunIdentity, config: Mapping[str, Any]) -> str | None:
    """'layers [0, 1] in the shard, [0] in the manifest': where a shard's HEAD says its states are other
    than its run's manifest `config` does (a manifest edited by hand; the loader would shape every batch
    by the wrong one). None where they agree. Only what the manifest records is compared: a key it
    lacks (a run made through the Python API may omit final_state or hidden_size) agrees with any."""
    differs = [f"{name} {getattr(header, name)!r} in the shard, {config[name]!r} in the manifest"
               for name in STATE_FIELDS if config.get(name) is not None and getattr(header, name) != config[name]]
    return "; ".join(differs) or None


@dataclass(frozen=True, kw_only=True)
class RunConfig(RunIdentity):
    """A run's identity with the extraction settings its manifest pins too: `manifest.json`'s
    `config`, compared key by key when a run is resumed (`Manifest.differences`)."""

    gguf_file: str | None = None
    model_type: str | None = None
    dtype: str | None = None  # the forward dtype asked for ("auto": each worker's choice)
    max_length: int | None = None
    # Content hashes (extract/model.py) of what a name alone does not pin: a folder edited in place,
    # a tokenizer swapped. None where unknown (then not written); compared only where the run recorded
    # one (`IF_RECORDED`).
    model_config_sha256: str | None = None  # the checkpoint's config.json (None for a GGUF)
    tokenizer_sha256: str | None = None  # vocabulary and special tokens
    chat_template_sha256: str | None = None  # the chat template that renders chat rows

    def to_json(self) -> dict[str, Any]:
        """The manifest's keys in the order extraction has always written them, then the content
        hashes that are known: a config without them (an import's, an earlier layertap's) keeps
        the very keys it had."""
        d = super().to_json()
        return {k: d[k] for k in _MANIFEST_ORDER if d[k] is not None or k not in _HASHES}


_HASHES = ("model_config_sha256", "tokenizer_sha256", "chat_template_sha256")
_MANIFEST_ORDER = ("model", "gguf_file", "model_revision", "model_type", "tokenizer", "layers", "layer_convention",
                   "final_state", "hidden_size", "codec", "dtype", "max_length", *_HASHES)
assert set(_MANIFEST_ORDER) == {f.name for f in fields(RunConfig)}

# Facts a run may lack: recorded None (a local folder has no revision; earlier layertap versions lost
# a hub id's) or not recorded at all (the hashes are newer than many runs). A rerun cannot be checked
# against what the run never knew, so it resumes; where the run knows, it must match.
IF_RECORDED = ("model_revision", *_HASHES)
