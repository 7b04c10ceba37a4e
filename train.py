"""Pre-train BERT or GPT-NeoX with DeepSpeed: the program the ``deepspeed`` launcher runs on every rank.

It reads the arguments and maps what the run raises to an exit code; the run itself is ``training.start``'s.

deepspeed --num_gpus N train.py --config configs/smoke.yaml [section.key=value ...]
python train.py --config smoke            # one process
python train.py --config X --print-config # resolved config and the generated DeepSpeed JSON, then exit
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from common.errors import EXIT_PEER_LOST, EXIT_USER_ERROR, SUPERVISED_ENV, USER_ERROR_WAIT_S, RankError, UserError
from common.log import get_logger
from data.reads import ShardDamaged, ShardUnavailable
from training import events, ownership
from training.config import Config, gradient_accumulation, load_config

log = get_logger("train")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="a YAML file or a recipe name in configs/ (e.g. smoke)")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optimizer.lr=3e-3 train.steps=100")
    return p.parse_args(argv)


def end_rank(cfg: Config | None, why: str, line: str) -> NoReturn:
    """End this rank on a fault the job resumes from: a ``failure`` event, ``error: rank R: LINE``, exit 4,
    without a teardown (it would wait on ranks blocked in the step's collective)."""
    rank = os.environ.get("RANK", "0")
    if cfg is not None:
        events.record(Path(cfg.run.dir), "failure", rank=int(rank), why=why)
        ownership.release(Path(cfg.run.dir))  # the job ends in order: the next start proceeds at once
    print(f"error: rank {rank}: {line}", file=sys.stderr, flush=True)
    os._exit(EXIT_PEER_LOST)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cfg: Config | None = None
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            from training.engine import check_setup, deepspeed_config  # on call (start-up time), as start.run
            from training.start import static_plan  # on call (start-up time), as start.run

            static_plan(cfg.model, cfg.data)  # what a run refuses before it starts: an unknown model, ...
            check_setup(cfg)
            accum = gradient_accumulation(cfg.train, int(os.environ.get("WORLD_SIZE", "1")))
            ds = deepspeed_config(cfg, accum, cfg.run.dir)
            print(json.dumps({"config": cfg.to_dict(), "deepspeed": ds}, indent=2))
            return 0
        # on call (start-up time): torch loads once the arguments and the config are read, so --help and a bad
        # config answer at once (the imports at the top load no torch)
        from training import start

        return start.run(cfg)
    except ShardUnavailable as e:  # the filesystem failed the read through every retry: resume when it serves
        end_rank(cfg, e.one_line(), e.one_line())
    except ownership.RunOwned as e:  # another job's run: nothing is written there, no event (that job would read it)
        if local_rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except UserError as e:
        # every rank raises the same error: one line per node, in each node's log; a RankError is this rank's own
        if local_rank == 0 or isinstance(e, RankError):
            print(f"error: {e}", file=sys.stderr, flush=True)
        under_agent = "TORCHELASTIC_RUN_ID" in os.environ  # launch elastic must not retry it: it reads this
        own = int(os.environ.get("RANK", "0"))
        if cfg is not None and isinstance(e, ShardDamaged):  # a run's failure, not a start refused: goodput's
            events.record(Path(cfg.run.dir), "failure", rank=own, why=str(e))
        if cfg is not None and under_agent and (own == 0 or isinstance(e, RankError)):
            events.record(Path(cfg.run.dir), "user_error", rank=own, message=str(e))
        if cfg is not None and under_agent and os.environ.get(SUPERVISED_ENV):
            import time  # on call: as in end_rank

            time.sleep(USER_ERROR_WAIT_S)  # launch elastic ends this process meanwhile (see SUPERVISED_ENV)
        return EXIT_USER_ERROR
    except RuntimeError as e:  # torch.distributed's DistBackendError included
        # on call (start-up time), as start.run: loaded already by the time a collective fails
        from training import engine as ds_engine
        from training.collectives import peer_lost

        why = peer_lost(e)
        if why is None:
            raise
        first = str(e).strip().splitlines()[0][-160:]
        dump = ""
        if cfg is not None and ds_engine.backend_for(cfg.deepspeed) == "nccl":
            dump = ds_engine.flight_recorder_note(int(os.environ.get("RANK", "0")), os.environ)
        end_rank(cfg, why, f"{why}; the job ends here and resumes from its last checkpoint ({first}){dump}")
    finally:
        from common.process import end_process_group  # on call: as in end_rank

        ownership.release(Path(cfg.run.dir) if cfg is not None else None)  # rank 0's marks, after its last write
        end_process_group()


if __name__ == "__main__":
    from common.process import exit_fast

    exit_fast(main())
