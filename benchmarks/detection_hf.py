"""The shipped rules on a model, data and seeds they were never tuned on (issue 13's outside
check): a Hugging Face Mixtral built from a config (3 layers, width 64, 4 query heads of 16
over 2 KV heads, 4 experts top-2: GQA attention, RoPE, a real HF router), trained on a random
hidden-Markov language (not the test bed's Markov chains), with the default ``Agent`` inside
the loop in detect-only mode.

    python benchmarks/detection_hf.py [--seeds 7] [--steps 2000] [--model mixtral]
        [--qk-layers-per-eval N] [--qk-heads-per-layer N]
        [--rules FILES...] [--out FILE]

``--model qwen2_moe`` trains a Qwen2-MoE of the same size instead (biases on Q, K and V, a
shared expert beside the routed ones with its own one-output gate, which is not a router):
a second architecture the rules were never tuned on. ``--model llama`` trains a dense Llama
twice as wide and a layer deeper (4 layers, width 128, 8 query heads of 16 over 4 KV heads, no
router): a bigger dense model whose healthy phase transitions the FA rules must not take for a
fault (the router scenarios do not apply to it).

Scenarios per seed: ``clean``; ``data_shift`` (batches from another HMM from step 1000: a
benign change); ``lr_x2`` (the whole model's learning rate doubled from step 500, balancing
loss on: a benign push on every router at once, which the router rule must not take for a
router fault); ``lr_x5`` (the same x5: a global push strong enough that it may destabilize the
routers with everything else; it asks whether a global cause collapses routers, and what the
rules call it); ``lr_x0.1`` (the whole model's learning rate cut to a tenth from step 500: a
step decay's cut, a benign change that steps H(Delta_2) down once); ``batch_x2``,
``mixture_step`` and ``seq_len_x4`` (benign one-time steps at step 1000 that the optimizer does
not show: the batch doubled from 16 to 32 sequences; both languages from the start, the other
one's share flipped from a quarter to three quarters; 16-token sequences before, 64 after);
``fa_floor_3``,
``fa_floor_4`` and ``fa_floor_6`` (the attention backward's dS rounded towards -inf to 3, 4 or
6 mantissa bits from step 500; 3 bits: an FP8 e4m3 kernel's, through an attention function
registered with transformers that runs the test bed's emulated arithmetic; nothing else
changes);
``router_x30_nobal`` and ``router_x10_nobal`` (the routers' LR x30 or x10 and the balancing
loss off from step 500);
``combined`` (``fa_floor_4`` and ``router_x30_nobal`` together, both from step 500);
``combined_6`` (the same with the weaker ``fa_floor_6``: an attention fault whose signature
shows late, the case the downstream rule of ``agent/attribution.py`` can write off). The clean
run of the seed is each fault's twin. Every run is printed: the first mechanism alert and its
family, the incident's family at the first page and at the end, the loss detectors people use
today on the same losses, the twin's degradation step and the divergence. One process at a
time, one torch thread. With ``--root``, runs already there (``result.json``) are reused;
``--rules`` replays them through other rule files than the shipped packs (to try a rule).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SCENARIOS = (
    "clean",
    "data_shift",
    "lr_x2",
    "lr_x5",
    "lr_x0.1",
    "batch_x2",
    "mixture_step",
    "seq_len_x4",
    "fa_floor_3",
    "fa_floor_4",
    "fa_floor_6",
    "router_x30_nobal",
    "router_x10_nobal",
    "combined",
    "combined_6",
)
FA_BITS = {"fa_floor_3": 3, "fa_floor_4": 4, "fa_floor_6": 6, "combined": 4, "combined_6": 6}
# The router faults' LR multiplier (the balancing loss is switched off with each).
ROUTER_FAULTS = {
    "router_x30_nobal": 30.0,
    "router_x10_nobal": 10.0,
    "combined": 30.0,
    "combined_6": 30.0,
}
# The whole model's LR multiplier from FAULT_START (every parameter group).
GLOBAL_LR = {"lr_x2": 2.0, "lr_x5": 5.0, "lr_x0.1": 0.1}
FAULT_START, SHIFT_STEP = 500, 1000
VOCAB, STATES, SEQ, BATCH = 128, 16, 64, 16
# The one-time healthy steps the optimizer does not show, all at SHIFT_STEP: the batch doubled
# (a batch-size ramp's step), the two languages' mixture flipped from a quarter to three
# quarters of the other one (both from the start), sequences 16 tokens long before (a
# sequence-length curriculum's step).
BENIGN_STEPS = ("batch_x2", "mixture_step", "seq_len_x4")
MIX_BEFORE, MIX_AFTER, SHORT_SEQ = 0.25, 0.75, 16
LR, WARMUP, BALANCE = 1e-2, 100, 0.01
ATTENTION = "mechwatch_emulated"
# The HF config sizes every architecture shares unless its MODELS entry says otherwise.
SHARED_SIZES: dict[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,  # of 16 (hidden / heads)
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
}
# The architectures ``--model`` builds: the HF config of each beyond the shared sizes.
MODELS: dict[str, dict[str, Any]] = {
    "mixtral": {"head_dim": 16, "num_local_experts": 4},
    "llama": {  # dense (DENSE_MODELS); the shared sizes overridden
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 16,
    },
    "qwen2_moe": {
        "moe_intermediate_size": 48,
        "shared_expert_intermediate_size": 96,
        "num_experts": 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}
DENSE_MODELS = frozenset({"llama"})  # no router: the router scenarios do not apply


class HiddenMarkovLanguage:
    """Token sequences from a random sparse HMM: each hidden state moves to one of 3 states
    and emits one of 8 tokens, with Dirichlet(0.5) probabilities (seeded)."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.trans = self._sparse(STATES, 3, g)  # (S, S)
        self.emit = self._sparse(VOCAB, 8, g)  # (S, V)
        self.g = torch.Generator().manual_seed(seed + 1)

    @staticmethod
    def _sparse(width: int, support: int, g: torch.Generator) -> torch.Tensor:
        out = torch.zeros(STATES, width)
        for row in out:
            idx = torch.randperm(width, generator=g)[:support]
            row[idx] = torch._sample_dirichlet(torch.full((support,), 0.5), generator=g)
        return out

    def batch(self, size: int = BATCH, length: int = SEQ) -> torch.Tensor:
        """(size, length) token ids."""
        state = torch.randint(0, STATES, (size,), generator=self.g)
        tokens = []
        for _ in range(length):
            tokens.append(torch.multinomial(self.emit[state], 1, generator=self.g).squeeze(1))
            state = torch.multinomial(self.trans[state], 1, generator=self.g).squeeze(1)
        return torch.stack(tokens, dim=1)


class EmulatedAttention:
    """An attention function for transformers' ``AttentionInterface``: the test bed's
    emulated-precision backward (``agent.testbed.attention``), its fault switched on and off by
    the loop."""

    def __init__(self) -> None:
        self.fault: Any = None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        from agent.testbed.attention import emulated_attention

        groups = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(groups, dim=1)  # (B, H, T, d_h)
        value = value.repeat_interleave(groups, dim=1)
        out = emulated_attention(query, key, value, scale=scaling, fault=self.fault)
        return out.transpose(1, 2).contiguous(), None  # (B, T, H, d_h)


def build(seed: int, attention: EmulatedAttention, model: str = "mixtral") -> torch.nn.Module:
    import transformers
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    config = transformers.AutoConfig.for_model(
        model,
        vocab_size=VOCAB,
        **(SHARED_SIZES | MODELS[model]),
        max_position_embeddings=SEQ,
        router_aux_loss_coef=BALANCE,
        output_router_logits=True,
        attn_implementation=ATTENTION,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def run(
    scenario: str,
    seed: int,
    steps: int,
    run_dir: Path,
    fault_start: int = FAULT_START,
    model_name: str = "mixtral",
    qk: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One whole run with the default agent (detect-only; ``qk``: AgentConfig ``qk`` settings
    that differ from the default): its per-step losses and wall time."""
    from agent.agent import Agent
    from agent.testbed.attention import AttentionFault
    from agent.testbed.supervised import default_agent_config

    if model_name in DENSE_MODELS and scenario in ROUTER_FAULTS:
        raise ValueError(f"scenario {scenario!r} needs a router; the {model_name} model is dense")
    from remediations.hf_attention import install_hf_attention

    attention = EmulatedAttention()
    model = build(seed, attention, model_name)
    # Through the FP32 switch's dispatcher, as a user's model would be: the emulated kernel is
    # a custom implementation the FP32 backward cannot reproduce, installed for the kernel
    # audit (detect-only: the switch is never flipped). Bit for bit the same run.
    install_hf_attention(model, audit_any_implementation=True)
    # The routers' weights (``...mlp.gate.weight``; not Qwen2-MoE's ``shared_expert_gate``).
    routers = [p for n, p in model.named_parameters() if _is_router(n)]
    others = [p for n, p in model.named_parameters() if not _is_router(n)]
    optimizer = torch.optim.AdamW(
        [{"params": others}, {"params": routers}], lr=LR, betas=(0.9, 0.95), weight_decay=0.0
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / WARMUP))
    agent = Agent(
        model,
        optimizer,
        scheduler,
        default_agent_config(
            run_dir, remediate=False, checkpoints={"enabled": False}, **({"qk": qk} if qk else {})
        ),
    )
    data = HiddenMarkovLanguage(seed)
    shifted = HiddenMarkovLanguage(seed + 1000)
    mixer = torch.Generator().manual_seed(seed + 2000)  # which rows the other language writes
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        if step == fault_start and scenario in FA_BITS:
            attention.fault = AttentionFault(sites=("dS",), bits=FA_BITS[scenario], mode="floor")
        if step == fault_start and scenario in ROUTER_FAULTS:
            optimizer.param_groups[1]["lr_mult"] = ROUTER_FAULTS[scenario]
            model.config.router_aux_loss_coef = 0.0
            model.router_aux_loss_coef = 0.0
        if step == fault_start and scenario in GLOBAL_LR:
            for group in optimizer.param_groups:
                group["lr_mult"] = GLOBAL_LR[scenario]
        ids = _batch(scenario, step, data, shifted, mixer)
        out = model(ids, labels=ids)
        optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # before clipping
        optimizer.step()
        scheduler.step()
        for group in optimizer.param_groups:  # the router fault multiplies its group's LR
            group["lr"] *= group.get("lr_mult", 1.0)
        # The language-model loss (the balancing term taken out): what the detectors watch.
        aux = getattr(out, "aux_loss", None)  # None on a dense model
        lm_loss = out.loss.detach()
        if aux is not None:
            lm_loss = lm_loss - model.router_aux_loss_coef * aux.detach()
        losses.append(float(lm_loss))
        agent.step(step, loss=lm_loss, grad_norm=grad_norm)
    agent.close()
    return {"losses": losses, "wall_s": time.perf_counter() - t0}


def _batch(
    scenario: str,
    step: int,
    data: HiddenMarkovLanguage,
    shifted: HiddenMarkovLanguage,
    mixer: torch.Generator,
) -> torch.Tensor:
    """The step's (batch, length) token ids under the scenario's data schedule."""
    after = step >= SHIFT_STEP
    if scenario == "data_shift":
        return (shifted if after else data).batch()
    if scenario == "batch_x2":
        return data.batch(size=2 * BATCH if after else BATCH)
    if scenario == "seq_len_x4":
        return data.batch(length=SEQ if after else SHORT_SEQ)
    if scenario == "mixture_step":
        other = torch.rand(BATCH, generator=mixer) < (MIX_AFTER if after else MIX_BEFORE)
        return torch.where(other[:, None], shifted.batch(), data.batch())  # (BATCH, SEQ)
    return data.batch()


def _is_router(name: str) -> bool:
    return name.split(".")[-2:] == ["gate", "weight"]


def evaluate(
    scenario: str,
    seed: int,
    result: dict,
    twin: list[float] | None,
    events: Path,
    rules: list[Path] | None = None,
):
    from agent.attribution import MECHANISM_FAMILIES
    from agent.replay import replay
    from agent.testbed.divergence import degradation_step, divergence_step
    from agent.testbed.loss_baselines import BASELINES
    from remediations.registry import validate_action

    fault = scenario not in ("clean", "data_shift", *BENIGN_STEPS)
    start = FAULT_START if fault else (100 if scenario == "clean" else SHIFT_STEP)
    replayed = replay(events, rules, action_validator=validate_action)
    first = replayed.first_firing()
    mech = {f: first[f] for f in MECHANISM_FAMILIES if f in first}
    losses = result["losses"]
    return {
        "scenario": scenario,
        "seed": seed,
        "first_mech": min(mech.values()) if mech else None,
        "first_family": min(mech, key=mech.get) if mech else None,
        "first_fa": first.get("fa_precision"),
        "first_router": first.get("router_instability"),
        "paged_as": replayed.paged_attribution(),
        "at_end": replayed.attribution(),
        "incidents": sorted({e["incident"]["family"] for e in replayed.incidents}),
        # (over the steps both runs have: a twin read back from an event log lacks the steps
        # after its last read-out)
        "twin_degradation": (
            degradation_step(losses[: len(twin)], twin, min_step=start) if twin else None
        ),
        "divergence": divergence_step(losses, min_step=start),
        **{name: detect(losses, min_step=start) for name, detect in BASELINES.items()},
        "final_loss": f"{sum(losses[-100:]) / 100:.3f}",  # mean of the last 100 steps
        "wall_s": round(result["wall_s"], 1),
        "steps_recorded": len(losses),
    }


COLUMNS = (
    "scenario",
    "seed",
    "first_mech",
    "first_family",
    "first_fa",
    "first_router",
    "paged_as",
    "at_end",
    "twin_degradation",
    "divergence",
    "zscore_128_6sigma",
    "ema_rise_0.1",
    "lightning_spike",
    "final_loss",
    "wall_s",
    "steps_recorded",
)


def markdown(rows: list[dict[str, Any]]) -> list[str]:
    """The runs as a table (every run; "-" where nothing fired)."""
    from detection_report import table
    from provenance import provenance

    return provenance() + table(rows, COLUMNS)


def main(argv: list[str] | None = None) -> int:
    from detection import add_sampling_options, sampling

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[7])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--model", choices=list(MODELS), default="mixtral")
    p.add_argument("--root", type=Path, default=None, help="keep the runs' event logs here")
    p.add_argument(
        "--rules", type=Path, nargs="+", default=None, help="replay with these rule files"
    )
    p.add_argument("--out", type=Path, default=None)
    add_sampling_options(p)
    args = p.parse_args(argv)
    qk = sampling(args) or None
    if args.model in DENSE_MODELS:  # the router faults do not apply
        skipped = [s for s in args.scenarios if s in ROUTER_FAULTS]
        if skipped:
            print(f"{args.model} has no router: skipping {', '.join(skipped)}", file=sys.stderr)
        args.scenarios = [s for s in args.scenarios if s not in ROUTER_FAULTS]
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root or Path(tmp)
        prefix = "hf_" if args.model == "mixtral" else f"hf_{args.model}_"  # run folders
        for seed in args.seeds:
            results: dict[str, dict] = {}
            scenarios = ["clean", *(s for s in args.scenarios if s != "clean")]  # twin first
            for scenario in scenarios:
                folder = root / f"{prefix}{scenario}_s{seed}"
                saved = folder / "result.json"
                if saved.exists():
                    results[scenario] = json.loads(saved.read_text())
                else:
                    results[scenario] = run(
                        scenario, seed, args.steps, folder, model_name=args.model, qk=qk
                    )
                    saved.write_text(json.dumps(results[scenario]))
                if scenario not in args.scenarios:
                    continue
                twin = results["clean"]["losses"] if scenario != "clean" else None
                row = evaluate(
                    scenario, seed, results[scenario], twin, folder / "events.jsonl", args.rules
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text("\n".join(markdown(rows)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
