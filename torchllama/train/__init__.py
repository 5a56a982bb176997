"""Training a Llama from scratch: tokenizer training, token datasets, the training loop with
exact resume, and scale-out with torchrun (DDP / FSDP2).

    torchllama train-tokenizer --input TEXTS... --vocab-size 4096 --out tok/
    torchllama prepare-data --input TEXTS... --tokenizer tok/tokenizer.model --out data/
    torchllama train --preset shakespeare-small --data data/ --out run/
    torchrun --nproc-per-node 2 -m torchllama.train --preset ... --parallel fsdp
    torchllama plot-log run/
    torchllama ablate --data data/ --out ablation/
    torchllama generate --model run/latest --prompt "..."
"""

from torchllama.train.ablate import run_ablation
from torchllama.train.data import TokenBatches, prepare_data, train_tokenizer
from torchllama.train.loop import TrainConfig, train
from torchllama.train.optim import init_weights, lr_at, make_optimizer
from torchllama.train.plot import plot_log
from torchllama.train.trainer import Trainer

__all__ = ["TokenBatches", "TrainConfig", "Trainer", "init_weights", "lr_at", "make_optimizer",
           "plot_log", "prepare_data", "run_ablation", "train", "train_tokenizer"]
