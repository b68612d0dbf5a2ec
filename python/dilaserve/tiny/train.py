"""Masked-diffusion training of dilaserve-tiny (the LLaDA SFT objective) on the task suite.

Each example is `prompt + answer + EOS padding`. Per example a mask ratio t ~ U(0, 1)
(stratified across the batch) is drawn and every answer position (EOS padding included,
as LLaDA does) is replaced by the mask token with probability p = (1 - eps) t + eps. The
loss is the cross-entropy on the masked answer positions weighted by 1/p and normalised by
the answer length (LLaDA eq. 5 / MDLM's 1/t weighting); prompt tokens are never masked.
Tasks are drawn in `tasks.TRAINING_WEIGHTS`, after a first stretch of `add` alone.

The block diffusion model (`family="llada2_moe"`, dilaserve-tiny-moe) attends
block-causally, so a block is only ever denoised with every earlier block clean: per example
one block that decoding produces (from the first answer block to the block of the first
EOS) is drawn, the example is cut at its end, and only that block's answer positions are
masked (as SDAR and LLaDA2's block SFT train, one noisy block
over a clean prefix). Its routers are balanced without an auxiliary loss, as LLaDA2's are:
after each step every expert's selection bias moves by `router_bias_rate` towards equal
load.

The run is deterministic for a seed (one data stream, one torch generator, fixed thread
count), logs JSON lines, and saves a resumable state plus an HF-format checkpoint directory
every `save_every` steps, so partial progress is usable.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dilaserve.models import LLADA, DiffusionLM, save_checkpoint
from dilaserve.models.llada2 import LLADA2
from dilaserve.models.moe import Router
from dilaserve.tiny import tasks
from dilaserve.tiny.tokenizer import EOS_ID, MASK_ID, PAD_ID, VOCAB_SIZE, encode, save_tokenizer

MASK_EPS = 1e-3
MAX_SEQUENCE_LENGTH = 512


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a training run (saved next to its checkpoints)."""

    seed: int = 0
    steps: int = 24000
    # The first `solo_steps` steps train `solo_task` alone: in the task mixture, addition sits
    # on a loss plateau it does not leave within the budget; alone it leaves it within a few
    # hundred steps, and the mixture then keeps improving it.
    solo_task: str = "add"
    solo_steps: int = 1500
    batch_tokens: int = 2048  # padded tokens per optimizer step
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 200
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    mlp_hidden_size: int = 768
    threads: int = 2
    bf16: bool = True  # bf16 autocast (CPUs with AMX / AVX512-bf16 nearly double speed)
    pool_size: int = 1024  # examples sorted by length together, to batch similar lengths
    log_every: int = 25
    save_every: int = 250
    # "llada2_moe": the block diffusion MoE model, with the settings below.
    family: str = "llada"
    block_size: int = 8
    num_experts: int = 8
    experts_per_token: int = 2
    expert_hidden_size: int = 192
    router_bias_rate: float = 1e-3


#: The embedded block diffusion model's run: 4 layers of 256 (GQA, 4 KV heads), the first
#: dense, then 8 experts of 192 chosen 2 at a time plus one shared (as many active FFN
#: weights per token as dilaserve-tiny's 768); a shorter run than dilaserve-tiny's. In fp32:
#: bf16 autocast pays only on CPUs with AVX512-bf16 or AMX and is ten times slower without.
TINY_MOE = TrainConfig(family="llada2_moe", steps=8000, solo_steps=1000, threads=1, bf16=False)


def llada_config(cfg: TrainConfig) -> dict[str, Any]:
    """config.json of the tiny model, with the keys of a released LLaDA checkpoint."""
    return {
        "architectures": ["LLaDAModelLM"],
        "model_type": "llada",
        "activation_type": "silu",
        "alibi": False,
        "attention_layer_norm": False,
        "bias_for_layer_norm": False,
        "block_group_size": 1,
        "block_type": "llama",
        "d_model": cfg.d_model,
        "embedding_size": 64,
        "eos_token_id": EOS_ID,
        "include_bias": False,
        "include_qkv_bias": False,
        "input_emb_norm": False,
        "layer_norm_type": "rms",
        "layer_norm_with_affine": True,
        "mask_token_id": MASK_ID,
        "max_sequence_length": MAX_SEQUENCE_LENGTH,
        "mlp_hidden_size": cfg.mlp_hidden_size,
        "n_heads": cfg.n_heads,
        "n_kv_heads": cfg.n_heads,
        "n_layers": cfg.n_layers,
        "pad_token_id": PAD_ID,
        "rms_norm_eps": 1e-5,
        "rope": True,
        "rope_theta": 10000.0,
        "scale_logits": False,
        "vocab_size": VOCAB_SIZE,
        "weight_tying": False,
    }


def llada2_config(cfg: TrainConfig) -> dict[str, Any]:
    """config.json of the tiny block diffusion model, with the keys of a released LLaDA2.x
    checkpoint (`LLaDA2MoeConfig`)."""
    return {
        "architectures": ["LLaDA2MoeModelLM"],
        "model_type": "llada2_moe",
        "block_length": cfg.block_size,
        "eos_token_id": EOS_ID,
        "first_k_dense_replace": 1,
        "head_dim": cfg.d_model // cfg.n_heads,
        "hidden_act": "silu",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_hidden_size,
        "mask_token_id": MASK_ID,
        "max_position_embeddings": MAX_SEQUENCE_LENGTH,
        "moe_intermediate_size": cfg.expert_hidden_size,
        "n_group": 4,
        "norm_head": False,
        "num_attention_heads": cfg.n_heads,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "num_hidden_layers": cfg.n_layers,
        "num_key_value_heads": cfg.n_heads // 2,
        "num_shared_experts": 1,
        "pad_token_id": PAD_ID,
        "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "routed_scaling_factor": 2.5,
        "tie_word_embeddings": False,
        "topk_group": 2,
        "torch_dtype": "bfloat16",
        "use_bias": False,
        "use_qk_norm": True,
        "use_qkv_bias": False,
        "use_rmsnorm": True,
        "vocab_size": VOCAB_SIZE,
    }


def build_model(cfg: TrainConfig, generator: torch.Generator) -> DiffusionLM:
    """A freshly initialised model: N(0, 0.02) weights, residual outputs scaled by
    1/sqrt(2 * layers) (GPT-2 style), unit norms."""
    if cfg.family == "llada2_moe":
        config = LLADA2.parse(llada2_config(cfg), Path("config.json"))
    elif cfg.family == "llada":
        config = LLADA.parse(llada_config(cfg), Path("config.json"))
    else:
        raise ValueError(f"unknown training family {cfg.family!r}: llada or llada2_moe")
    model = DiffusionLM(config)
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif param.dim() == 1:
                param.zero_()
            else:
                std = residual_std if name.endswith(("attn.o.weight", "down.weight")) else 0.02
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    return model


@dataclass
class Example:
    ids: list[int]
    answer_start: int  # first answer position; everything from here on is a loss position


def make_example(problem: tasks.Problem, rng: random.Random) -> Example:
    """prompt + answer + EOS + a random amount of EOS padding, so the model learns to end
    an answer whatever number of output positions decoding offers."""
    prompt, answer = encode(problem.prompt), encode(problem.answer)
    extra = rng.randint(0, 8) if rng.random() < 0.75 else rng.randint(0, 40)
    tail = [*answer, EOS_ID, *[EOS_ID] * extra]
    return Example(prompt + tail, len(prompt))


class BatchStream:
    """Endless batches of similar-length examples, at most `batch_tokens` padded tokens.

    Examples are drawn a pool at a time, sorted by length and cut into batches, which are
    served in random order. The pending batches are part of the state, so a resumed run sees
    exactly the batches an uninterrupted one would.
    """

    def __init__(self, cfg: TrainConfig, rng: random.Random) -> None:
        self.cfg = cfg
        self.rng = rng
        self.pending: list[list[Example]] = []

    def next_batch(self, step: int) -> list[Example]:
        """A batch for optimizer step `step` (which decides the task mix of a new pool)."""
        if not self.pending:
            solo = step < self.cfg.solo_steps
            self.pending = self._pool((self.cfg.solo_task,) if solo else None)
        return self.pending.pop()

    def _pool(self, only: tuple[str, ...] | None) -> list[list[Example]]:
        cfg, rng = self.cfg, self.rng
        pool = [
            make_example(tasks.sample_problem(rng, only, tasks.TRAINING_WEIGHTS), rng)
            for _ in range(cfg.pool_size)
        ]
        pool.sort(key=lambda e: len(e.ids))
        groups: list[list[Example]] = [[]]
        for example in pool:
            longest = len(example.ids)  # sorted: the newest example is the longest
            if groups[-1] and longest * (len(groups[-1]) + 1) > cfg.batch_tokens:
                groups.append([])
            groups[-1].append(example)
        rng.shuffle(groups)
        return groups

    def state(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate(), "pending": self.pending}

    def restore(self, state: dict[str, Any]) -> None:
        self.rng.setstate(state["rng"])
        self.pending = state["pending"]


def one_noisy_block(example: Example, block: int, generator: torch.Generator) -> Example:
    """For a block-causal model: the example cut at the end of one block drawn among those
    decoding produces, its loss positions that block's answer positions.

    Decoding stops after the block that holds the first EOS, so later blocks of EOS padding
    are never decoded and are not drawn. The chosen block is whole: an example that ends
    inside it is padded with EOS, as the answer is followed by EOS wherever decoding ends.
    """
    first_eos = example.ids.index(EOS_ID, example.answer_start)
    first, last = example.answer_start // block, first_eos // block
    chosen = first + int(torch.randint(last - first + 1, (1,), generator=generator))
    end = (chosen + 1) * block
    ids = example.ids[:end] + [EOS_ID] * (end - len(example.ids))
    return Example(ids, max(example.answer_start, chosen * block))


def collate(
    examples: list[Example], generator: torch.Generator, block: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded clean ids, noised ids, validity, loss mask and per-position loss weight;
    with `block`, one noisy block per example (`one_noisy_block`).

    An example whose draw masks nothing contributes no loss; forcing a mask there would
    give one token the weight 1/p of a tiny p and make the estimate biased and noisy.
    """
    if block:
        examples = [one_noisy_block(e, block, generator) for e in examples]
    b, n = len(examples), max(len(e.ids) for e in examples)
    clean = torch.full((b, n), PAD_ID, dtype=torch.long)
    answer = torch.zeros((b, n), dtype=torch.bool)
    valid = torch.zeros((b, n), dtype=torch.bool)
    for i, e in enumerate(examples):
        clean[i, : len(e.ids)] = torch.tensor(e.ids)
        answer[i, e.answer_start : len(e.ids)] = True
        valid[i, : len(e.ids)] = True
    # Stratified mask ratios: one draw per equal slice of (0, 1), in random order.
    t = (torch.randperm(b, generator=generator) + torch.rand(b, generator=generator)) / b
    p = (1 - MASK_EPS) * t + MASK_EPS
    masked = answer & (torch.rand((b, n), generator=generator) < p[:, None])
    noisy = torch.where(masked, MASK_ID, clean)
    weight = masked / (p[:, None] * answer.sum(dim=1, keepdim=True)) / b
    return clean, noisy, valid, masked, weight


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio` of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def loss_of(model: DiffusionLM, cfg: TrainConfig, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    clean, noisy, valid, masked, weight = batch
    positions = torch.arange(clean.shape[1]).expand_as(clean)
    # The math SDPA backend trains ~1.5x faster on CPU than the flash one (backward).
    with (
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16),
        sdpa_kernel(SDPBackend.MATH),
    ):
        logits = model(noisy, positions, valid)
    ce = F.cross_entropy(logits.float()[masked], clean[masked], reduction="none")
    return (ce * weight[masked]).sum()


class RouterBalancer:
    """Auxiliary-loss-free load balancing of a MoE model's routers: counts the experts
    each router chose during a step, then moves each expert's selection bias by `rate`
    towards the mean load (up when under-used, down when over-used)."""

    def __init__(self, model: torch.nn.Module, rate: float) -> None:
        self.rate = rate
        self.loads: dict[Router, torch.Tensor] = {}
        for module in model.modules():
            if isinstance(module, Router):
                self.loads[module] = torch.zeros(module.moe.num_experts)
                module.register_forward_hook(self._count)

    def _count(self, router: Router, _inputs: Any, output: tuple[torch.Tensor, ...]) -> None:
        chosen = output[0].flatten()
        self.loads[router] += torch.bincount(chosen, minlength=len(self.loads[router]))

    @torch.no_grad()
    def update(self) -> None:
        for router, load in self.loads.items():
            router.expert_bias += self.rate * torch.sign(load.mean() - load)
            load.zero_()


class Trainer:
    """Owns the model, optimizer and data stream of one run; resumable from `out_dir`."""

    STATE_FILE = "train_state.pt"
    LOG_FILE = "train_log.jsonl"

    def __init__(self, cfg: TrainConfig, out_dir: str | Path) -> None:
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        torch.set_num_threads(cfg.threads)
        # Sharp attention puts denormal floats in the softmax and its gradients; on CPU they
        # slowed training threefold within 2000 steps. Flushing them to zero costs nothing.
        torch.set_flush_denormal(True)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.model = build_model(cfg, self.generator)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=cfg.lr,
            betas=(0.9, 0.98),
        )
        self.step = 0
        self.elapsed = 0.0
        self.data = BatchStream(cfg, random.Random(cfg.seed))
        self.block = self.model.config.block_size
        self.balancer = RouterBalancer(self.model, cfg.router_bias_rate)

    def resume(self) -> bool:
        """Continues from the saved state in `out_dir`, if there is one."""
        path = self.out_dir / self.STATE_FILE
        if not path.is_file():
            return False
        state = torch.load(path, weights_only=False)
        if state["config"] != asdict(self.cfg):
            raise ValueError(f"{path}: saved by a run with a different configuration")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.data.restore(state["data"])
        self.step, self.elapsed = state["step"], state["elapsed"]
        self._drop_log_records_after(self.step)
        return True

    def _drop_log_records_after(self, step: int) -> None:
        """An interrupted run may have logged steps past its last saved state; the resumed
        run logs them again."""
        path = self.out_dir / self.LOG_FILE
        if path.is_file():
            kept = [
                line
                for line in path.read_text().splitlines()
                if line and json.loads(line)["step"] <= step
            ]
            path.write_text("".join(line + "\n" for line in kept))

    def run(self, until: int | None = None) -> None:
        """Trains up to step `until` (default: the configured number of steps)."""
        last = self.cfg.steps if until is None else min(until, self.cfg.steps)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.model.train()
        log = (self.out_dir / self.LOG_FILE).open("a")
        window: list[float] = []
        while self.step < last:
            started = time.perf_counter()
            lr = learning_rate(self.cfg, self.step)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            batch = collate(self.data.next_batch(self.step), self.generator, self.block)
            loss = loss_of(self.model, self.cfg, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.balancer.update()
            self.step += 1
            self.elapsed += time.perf_counter() - started
            window.append(loss.item())
            if self.step % self.cfg.log_every == 0 or self.step == self.cfg.steps:
                record = {
                    "step": self.step,
                    "loss": sum(window) / len(window),
                    "lr": lr,
                    "elapsed_s": round(self.elapsed, 1),
                }
                log.write(json.dumps(record) + "\n")
                log.flush()
                window.clear()
            if self.step % self.cfg.save_every == 0 or self.step == self.cfg.steps:
                self.save()
        log.close()

    def save(self) -> None:
        """Writes the resumable state and the HF-format checkpoint of the current weights."""
        state = {
            "config": asdict(self.cfg),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "generator": self.generator.get_state(),
            "data": self.data.state(),
            "step": self.step,
            "elapsed": self.elapsed,
        }
        tmp = self.out_dir / (self.STATE_FILE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(self.out_dir / self.STATE_FILE)
        export(self.model, self.out_dir / "checkpoint")


def export(model: DiffusionLM, directory: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """The shippable checkpoint: config.json, weights in `dtype`, tokenizer files."""
    copy = DiffusionLM(model.config)
    copy.load_state_dict(model.state_dict())
    save_checkpoint(copy.to(dtype), directory)
    save_tokenizer(directory, max_length=MAX_SEQUENCE_LENGTH)
