"""`layertap export-drafter`: a `layertap train` output's drafter in another project's format."""

from __future__ import annotations

import argparse

FORMATS = ("speculators",)


def add_export_drafter(p: argparse.ArgumentParser) -> None:
    p.add_argument("train_out", metavar="TRAIN_OUT", help="a `layertap train` output (S3 prefix or folder)")
    p.add_argument("--to", required=True, choices=FORMATS, dest="format",
                   help="speculators: its DFlash checkpoint (model.safetensors + config.json), which vLLM serves")
    p.add_argument("dest", metavar="DEST", help="where to write it: a folder or s3://bucket/prefix")
    p.add_argument("--verifier", help="the verifier's name or path written into config.json (default: the target "
                                      "model the drafter records)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weights' dtype (default float32: the trained values exactly)")


def run_export_drafter(args: argparse.Namespace) -> int:
    from layertap.storage.store import open_store
    from layertap.train.export import export_speculators

    spec = export_speculators(open_store(args.train_out), open_store(args.dest), verifier=args.verifier,
                              dtype=args.dtype)
    print(f"wrote a speculators DFlash drafter to {args.dest} (block {spec['block_size']}, mask token "
          f"{spec['mask_token_id']}, aux_hidden_state_layer_ids {spec['aux_hidden_state_layer_ids']}, verifier "
          f"{spec['speculators_config']['verifier']['name_or_path']})")
    return 0
