"""Run under ``torchrun``: the ``reshard`` command line, recording the output files this rank writes.

``python -m torch.distributed.run --standalone --nproc-per-node 2 convert_shares.py LOG convert SRC DST ...``

Exactly what the ``reshard`` console script runs (``reshard.cli.main``), with
``reshard.execute.write_out_file`` wrapped to append each file name this rank writes
to ``LOG/rank-{RANK}.txt``, so the parent can check that the ranks split the output
files between them (and that no file is written twice).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def main() -> None:
    import reshard.execute as execute
    from reshard.cli import main as cli_main

    log = Path(sys.argv[1])
    rank = os.environ.get("RANK", "0")
    write = execute.write_out_file

    def recording(plan: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        with open(log / f"rank-{rank}.txt", "a", encoding="utf-8") as out:
            out.write(f.name + "\n")
        return write(plan, f, *args, **kwargs)

    execute.write_out_file = recording  # type: ignore[assignment]
    sys.argv = ["reshard", *sys.argv[2:]]
    cli_main()


if __name__ == "__main__":
    main()
