"""Run under ``torchrun``: the ``reshard`` command line, recording the output files this rank writes.

``python -m torch.distributed.run --standalone --nproc-per-node 2 convert_shares.py LOG convert SRC DST ...``

Exactly what the ``reshard`` console script runs (``reshard.cli.main``), with the
``execute_plan`` that ``reshard.convert`` calls wrapped to append the names of the
files this rank is given (its share) to ``LOG/rank-{RANK}.txt``, so the parent can
check that the ranks split the output files between them, none twice.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any


def main() -> None:
    import reshard.convert as convert
    from reshard.cli import main as cli_main

    log = Path(sys.argv[1])
    rank = os.environ.get("RANK", "0")
    execute_plan = convert.execute_plan

    def recording(plan: Any, dst: Any, **kwargs: Any) -> Any:
        files = kwargs.get("files")
        names = [f.name for f in (plan.files if files is None else files)]
        with open(log / f"rank-{rank}.txt", "a", encoding="utf-8") as out:
            out.write("".join(n + "\n" for n in names))
        return execute_plan(plan, dst, **kwargs)

    convert.execute_plan = recording  # type: ignore[assignment]
    sys.argv = ["reshard", *sys.argv[2:]]
    try:
        cli_main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    else:
        code = 0
    # as save_world.hard_exit: no interpreter teardown (a rare gloo abort in torch 2.13)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
