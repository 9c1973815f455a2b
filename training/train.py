"""Train ktserve's demo model: a small DeepSeek-V3 MoE (transformers' DeepseekV3ForCausalLM) on the
corpus from training.prepare_corpus, with the tokenizer from training.train_tokenizer.

Seeded end to end (init, data order). AdamW with warmup + cosine decay, bf16 autocast on CUDA,
aux-loss-free router balancing, validation perplexity every --eval-every steps (the best
checkpoint is kept), held-out perplexity of the saved bf16 files at the end.

Usage: python -m training.train --max-steps 3000 [--out-dir demo_model] [--seed 1234] ...
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3ForCausalLM

from training.data import WindowBatches, token_stream
from training.model_config import ModelSpec, build_config
from training.perplexity import perplexity_of_ids
from training.prepare_corpus import read_texts
from training.router_balance import RouterBalancer
from training.train_tokenizer import IM_END

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class TrainConfig:
    data_dir: Path = Path("training/data")
    tokenizer_dir: Path = Path("demo_model")
    out_dir: Path = Path("demo_model")
    summary_json: Path | None = None
    seed: int = 1234
    seq_len: int = 512
    batch_size: int = 32
    max_steps: int = 3000
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    balance_rate: float = 1e-2
    log_every: int = 50
    eval_every: int = 250
    eval_max_tokens: int = 32768
    max_time_s: float = 0.0  # 0: no limit; else stop early (and say so) past this many seconds
    experts_implementation: str = "grouped_mm"
    device: str = "cuda" if torch.cuda.is_available() else "cpu"

    def __post_init__(self) -> None:
        if self.max_steps < 1 or self.warmup_steps >= self.max_steps:
            raise ValueError("need max_steps >= 1 and warmup_steps < max_steps")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError("min_lr_ratio must be in [0, 1]")

    def lr_at(self, step: int) -> float:
        """Linear warmup, then cosine from lr down to lr * min_lr_ratio at max_steps."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / (self.max_steps - self.warmup_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine)


def _joined(path: Path) -> str:
    """A document file as one evaluation text (documents separated by a blank line)."""
    return "\n\n".join(read_texts(path))


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _pick_experts_implementation(model: DeepseekV3ForCausalLM, cfg: TrainConfig) -> str:
    """The requested experts implementation if a forward+backward works here, else eager."""
    probe = torch.zeros(2, 16, dtype=torch.long, device=cfg.device)
    for impl in dict.fromkeys((cfg.experts_implementation, "eager")):
        try:
            model.set_experts_implementation(impl)
            with _autocast(cfg.device):
                model(input_ids=probe, labels=probe).loss.backward()
            model.zero_grad(set_to_none=True)
            return impl
        except (RuntimeError, NotImplementedError, ValueError) as e:
            print(f"experts implementation {impl!r} failed here ({e}); trying the next")
    raise RuntimeError("no experts implementation works on this device")


def _autocast(device: str) -> torch.autocast:
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))


def _eval_ppl(model: torch.nn.Module, ids: list[int], seq_len: int) -> float:
    model.eval()
    ppl = perplexity_of_ids(model, ids, seq_len)
    model.train()
    return ppl


def save_bf16(model: DeepseekV3ForCausalLM, out_dir: Path, eos_id: int, im_end_id: int) -> None:
    """save_pretrained in bf16, except the router bias, kept fp32 as in DeepSeek-V3's release."""
    model = model.to(torch.bfloat16)
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.data = module.e_score_correction_bias.data.float()
    model.generation_config.eos_token_id = [eos_id, im_end_id]
    model.generation_config.pad_token_id = eos_id
    model.generation_config.bos_token_id = None
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)


def train(cfg: TrainConfig) -> dict:
    t_start = time.time()
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_dir)
    eos_id = tokenizer.eos_token_id
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    texts = read_texts(cfg.data_dir / "train.txt.gz") + read_texts(cfg.data_dir / "chat.txt.gz")
    stream = token_stream(tokenizer, texts, eos_id, cfg.seed)
    val_ids = tokenizer(_joined(cfg.data_dir / "val.txt.gz"), add_special_tokens=False)
    val_ids = val_ids["input_ids"][: cfg.eval_max_tokens]
    batches = WindowBatches(stream, cfg.seq_len, cfg.batch_size, cfg.seed)
    spec = ModelSpec(vocab_size=len(tokenizer))
    model = DeepseekV3ForCausalLM(build_config(spec, eos_id)).to(cfg.device)
    num_params = sum(p.numel() for p in model.parameters())
    impl = _pick_experts_implementation(model, cfg)
    print(
        f"params {num_params / 1e6:.2f}M | train tokens {stream.numel()} | "
        f"{batches.batches_per_epoch} steps/epoch | experts {impl} | device {cfg.device}",
        flush=True,
    )
    fused = cfg.device.startswith("cuda")
    opt = torch.optim.AdamW(
        _param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95), fused=fused
    )
    balancer = RouterBalancer(model, cfg.balance_rate)
    best = {"val_ppl": float("inf"), "step": -1, "state": None}
    losses: list[float] = []
    stopped_early = False
    model.train()
    t_train = time.time()
    step = 0
    for step in range(cfg.max_steps):
        for group in opt.param_groups:
            group["lr"] = cfg.lr_at(step)
        x = batches.batch(step).to(cfg.device, non_blocking=True)  # [B, S]
        with _autocast(cfg.device):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        balancer.update()
        if (step + 1) % cfg.log_every == 0 or step == 0:
            losses.append(loss.item())
            elapsed = time.time() - t_train
            tok_s = (step + 1) * cfg.batch_size * cfg.seq_len / elapsed
            print(
                f"step {step + 1:5d} | loss {losses[-1]:.4f} | lr {cfg.lr_at(step):.2e} | "
                f"max/mean expert load {balancer.last_imbalance.item():.2f} | "
                f"{tok_s:,.0f} tok/s | {elapsed:.0f}s",
                flush=True,
            )
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.max_steps:
            val_ppl = _eval_ppl(model, val_ids, cfg.seq_len)
            print(f"step {step + 1:5d} | val ppl {val_ppl:.3f}", flush=True)
            if val_ppl < best["val_ppl"]:
                best = {
                    "val_ppl": val_ppl,
                    "step": step + 1,
                    "state": copy.deepcopy(
                        {k: v.detach().cpu() for k, v in model.state_dict().items()}
                    ),
                }
        if cfg.max_time_s and time.time() - t_train > cfg.max_time_s:
            stopped_early = True
            print(f"time guard: stopped after step {step + 1} of {cfg.max_steps}", flush=True)
            if best["step"] != step + 1:
                val_ppl = _eval_ppl(model, val_ids, cfg.seq_len)
                if val_ppl < best["val_ppl"]:
                    best = {
                        "val_ppl": val_ppl,
                        "step": step + 1,
                        "state": copy.deepcopy(
                            {k: v.detach().cpu() for k, v in model.state_dict().items()}
                        ),
                    }
            break
    train_s = time.time() - t_train
    model.load_state_dict(best["state"])
    save_bf16(model, cfg.out_dir, eos_id, im_end_id)
    if cfg.tokenizer_dir.resolve() != cfg.out_dir.resolve():
        for name in TOKENIZER_FILES:
            shutil.copy2(cfg.tokenizer_dir / name, cfg.out_dir / name)
    saved = AutoModelForCausalLM.from_pretrained(cfg.out_dir, dtype=torch.float32).to(cfg.device)
    heldout_ids = tokenizer(_joined(cfg.data_dir / "heldout.txt.gz"), add_special_tokens=False)
    summary = {
        "params": num_params,
        "steps_run": step + 1,
        "max_steps": cfg.max_steps,
        "stopped_early": stopped_early,
        "best_step": best["step"],
        "train_tokens_per_epoch": stream.numel(),
        "epochs": (step + 1) / batches.batches_per_epoch,
        "last_train_loss": losses[-1],
        "val_ppl_best": best["val_ppl"],
        "val_ppl_saved_bf16": _eval_ppl(saved, val_ids, cfg.seq_len),
        "heldout_ppl_saved_bf16": _eval_ppl(saved, heldout_ids["input_ids"], cfg.seq_len),
        "heldout_tokens": len(heldout_ids["input_ids"]),
        "train_seconds": train_s,
        "total_seconds": time.time() - t_start,
        "experts_implementation": impl,
        "config": {k: str(v) for k, v in asdict(cfg).items()},
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}), flush=True)
    if cfg.summary_json:
        cfg.summary_json.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(TrainConfig, f.name)
        kind = {int: int, float: float, str: str}.get(type(default), Path)
        ap.add_argument(flag, type=kind, default=default)
    train(TrainConfig(**vars(ap.parse_args())))


if __name__ == "__main__":
    main()
