"""Worker for the 2-process (gloo, CPU) training test: run with torch.distributed.run."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers
from helpers import tiny_draft, tiny_llama  # noqa: E402

from transformers_poss.training.trainer import PosSTrainer, PosSTrainingArguments  # noqa: E402


def main(out_dir, unrolled_steps):
    torch.set_num_threads(1)
    target = tiny_llama()
    draft = tiny_draft(target, num_specialists=2, positions_per_specialist=1).train()
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(0, 128, (20,), generator=generator), "assistant_mask": torch.ones(20, dtype=torch.long)}
            for _ in range(16)]
    args = PosSTrainingArguments(output_dir=out_dir, per_device_train_batch_size=2, max_steps=3, use_cpu=True,
                                 report_to="none", save_strategy="no", learning_rate=1e-2, disable_tqdm=True,
                                 num_unrolled_steps=unrolled_steps, ddp_backend="gloo")
    trainer = PosSTrainer(model=draft, args=args, target=target, train_dataset=data[:12], eval_dataset=data[12:])
    trainer.train()
    metrics = trainer.evaluate()
    rank = int(os.environ.get("RANK", 0))
    record = {"world_size": trainer.args.world_size, "find_unused": args.ddp_find_unused_parameters,
              "fc": draft.fc.weight.double().sum().item(), "layer1": draft.layers[1].mlp.up_proj.weight.double().sum().item(),
              "eval_acc_1": metrics["eval_acc_1"]}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(record, handle)
    # no collective after this point: every rank has finished training and evaluation


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # results are written: skip the process-group teardown, where a gloo worker was seen to hang
