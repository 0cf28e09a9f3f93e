"""The codecs' names, apart from the codecs (`storage.codecs` imports torch): what manifests and
shard headers are checked against, in commands that never encode (`layertap status`)."""

DEFAULT_CODEC = "bf16-zstd"
CODEC_NAMES: tuple[str, ...] = ("bf16", "bf16-zstd", "fp8")
