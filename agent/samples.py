"""The unit of measurement that flows from monitors to the series store and the rules."""

from __future__ import annotations

from dataclasses import dataclass, field

# Metric names produced by the built-in probes. Rules select on these names; labels say
# where a value was measured: "layer" is the module name (str), "head" a query-head index
# (str), "router" the router's module name.
QK_DELTA1_ENTROPY = "qk_delta1_entropy"  # H(Delta_1), per layer and head
QK_DELTA2_ENTROPY = "qk_delta2_entropy"  # H(Delta_2), per layer and head (lead FA signal)
QK_DELTA3_ENTROPY = "qk_delta3_entropy"  # H(Delta_3), per layer and head
QK_DELTA2_STABLE_RANK = "qk_delta2_stable_rank"
QK_DELTA2_FROBENIUS = "qk_delta2_frobenius"
DWQ_ENTROPY = "dwq_entropy"  # H(dW_q^h), per layer and head
DWK_ENTROPY = "dwk_entropy"  # H(dW_k^g), per layer and KV head
WQ_SPECTRAL_NORM = "wq_spectral_norm"  # ||W_q^h||_2, per layer and head
WK_SPECTRAL_NORM = "wk_spectral_norm"  # ||W_k^g||_2, per layer and KV head
# |cos| between the top left singular vectors of Delta_2 at two successive evaluations of a
# head (1: the update keeps pushing one direction), per layer and head
QK_DELTA2_PERSISTENCE = "qk_delta2_persistence"
# Controls (agent/discovery/controls.py): other matrices of the same block (values, output
# projection, MLP), their update over the same delta steps; labels layer and param
CONTROL_UPDATE_ENTROPY = "control_update_entropy"  # H(dW) of a control matrix
CONTROL_UPDATE_REL_NORM = "control_update_rel_norm"  # ||dW||_F / ||W||_F of a control matrix
ROUTER_ENTROPY = "router_entropy"  # mean per-token routing entropy (nats), per router
ROUTER_ENTROPY_NORM = "router_entropy_norm"  # mean entropy / ln E
ROUTER_ENTROPY_P10 = "router_entropy_p10"  # 10th percentile of per-token entropy (nats)
ROUTER_EPS = "router_eps"  # centred conditioning ratio eps
ROUTER_SIMILARITY = "router_similarity"  # mean pairwise cosine of router rows
ROUTER_LOAD_MAX = "router_load_max"  # largest top-k load fraction
ROUTER_LOAD_ENTROPY = "router_load_entropy"  # entropy of the load distribution (nats)
ROUTER_MARGIN = "router_margin"  # mean top-1 minus top-2 probability
ROUTER_DEAD_EXPERTS = "router_dead_experts"  # experts that received no token
# ||W - W_prev||_F / ||W||_F of the router weight over one read-out (router.every steps)
ROUTER_UPDATE_REL_NORM = "router_update_rel_norm"
# the same over the router's MoE block's other weights (experts: from fixed sketches W G)
ROUTER_BLOCK_UPDATE_REL_NORM = "router_block_update_rel_norm"
# router_update_rel_norm / router_block_update_rel_norm: how much faster the router moves than
# the weights around it (a push on the router alone raises it; one on the whole model does not)
ROUTER_UPDATE_RATIO = "router_update_ratio"
# The kernel audit (remediations/kernel_audit.py): ||g(dO) + g(-dO)|| / ||g(dO) - g(-dO)|| of
# one call's q, k gradients; 0 for sign-symmetric arithmetic, the bias's size for one-way
# rounding; per layer, at each audit of it
ATTENTION_BACKWARD_ASYMMETRY = "attention_backward_asymmetry"
LOSS = "loss"
LOSS_NONFINITE = "loss_nonfinite"  # 1.0 when the loss is NaN or inf, else 0.0
GRAD_NORM = "grad_norm"
SECONDS_SINCE_STEP = "seconds_since_step"  # written by the watchdog
# the share of the agent.step calls since the previous symptom read-out that followed no real
# optimizer step (a GradScaler skipped it: agent/optimizer_steps.py), at those read-outs; none
# where the agent cannot tell (no optimizer, a wrapper torch does not hook, a distributed run)
OPTIMIZER_SKIPPED_SHARE = "optimizer_skipped_share"
# the optimizer's learning rate, per parameter group (label "group"), at the symptom read-outs
# (agent/schedule_steps.py: the attribution's schedule steps)
LEARNING_RATE = "lr"


Labels = tuple[tuple[str, str], ...]  # (name, value) pairs sorted by name


@dataclass(frozen=True, slots=True)
class Sample:
    """One measured value: ``metric`` at ``step`` for the place named by ``labels``."""

    step: int
    metric: str
    value: float
    labels: Labels = field(default=())

    @staticmethod
    def make(step: int, metric: str, value: float, **labels: str | int) -> Sample:
        return Sample(step=int(step), metric=metric, value=float(value), labels=labels_of(**labels))

    @property
    def label_dict(self) -> dict[str, str]:
        return dict(self.labels)

    def __reduce__(self) -> tuple[type[Sample], tuple[int, str, float, Labels]]:
        # Pickled as a constructor call: samples cross the monitor process's pipe by the dozen
        # per job (agent.monitor_worker), and this takes a third of the default's time for a
        # frozen slotted dataclass, on both sides (the training process's reader thread too).
        return Sample, (self.step, self.metric, self.value, self.labels)


def labels_of(**labels: str | int) -> Labels:
    """``Sample.labels`` for keyword labels, as ``Sample.make`` builds them: (name, str(value))
    pairs sorted by name. Made once for a place, they serve all of its samples
    (``Sample(step, metric, value, labels)``, a quarter of ``make``'s cost)."""
    return tuple(sorted((k, str(v)) for k, v in labels.items()))
