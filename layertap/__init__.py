"""layertap: capture a target model's hidden states into checksummed shards on S3, and stream
them back to train speculative-decoding drafters.

One installed name over the repository's folders: ``layertap.extract``, ``layertap.storage``,
``layertap.manifests``, ``layertap.train`` and ``layertap.slurm`` are the folders ``extract/``,
``storage/``, ... (pyproject.toml maps them), so no top-level ``train`` or ``storage`` package
collides with a user's own module. This folder holds only the ``layertap`` command's dispatcher.
"""

from __future__ import annotations

from pathlib import Path

_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "extract" / "__init__.py").is_file():
    # Run from a checkout (an editable install, or PYTHONPATH at the repository): the mapped
    # folders sit beside this one, not inside it. An installed wheel has them inside.
    __path__.append(str(_checkout))
