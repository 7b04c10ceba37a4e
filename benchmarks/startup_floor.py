"""The start-up floor, the peer of ``bench_startup.py``: the least a DeepSpeed rank must do before a first
step.

Import torch, DeepSpeed and transformers, start the process group, build the same BERT shape with
``transformers.BertForPreTraining``, ``deepspeed.initialize`` it (ZeRO-2, torch AdamW) and run one step on a
random batch. No data loading, no checks, no checkpoints, no logging: what any DeepSpeed program pays.

``--no-shm``: also keep DeepSpeed from building and mapping its CPU shared-memory all-reduce op, as train.py
does on gloo (``training.engine.no_shm_all_reduce``): no C++ build on a fresh machine, nothing left in
/dev/shm (the op's buffers outlive the job).
"""

from __future__ import annotations

import json
import os
import sys
import time

import psutil
import torch


def main() -> None:
    import deepspeed
    from transformers import BertConfig, BertForPreTraining

    from common.process import end_process_group

    torch.set_num_threads(1)
    if "--no-shm" in sys.argv[1:]:
        from training.engine import no_shm_all_reduce

        no_shm_all_reduce()
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    try:
        torch.manual_seed(0)
        cfg = BertConfig(
            vocab_size=8000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512
        )
        model = BertForPreTraining(cfg)
        ds = {
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": 2},
            "zero_allow_untested_optimizer": True,
        }
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
        ids = torch.randint(0, 8000, (8, 128))
        out = engine(input_ids=ids, labels=ids, next_sentence_label=torch.zeros(8, dtype=torch.long))
        engine.backward(out.loss)
        engine.step()
        age = time.time() - psutil.Process().create_time()
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps({"startup_s": age}), flush=True)
    finally:  # what a correct DeepSpeed program does; the interpreter's teardown stays (launch->exit times it)
        end_process_group()


if __name__ == "__main__":
    main()
