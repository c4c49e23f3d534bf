"""Control matrices of an attention layer: other weights of its block, never Q/K or routers."""

from __future__ import annotations

from torch import nn

from agent.discovery import find_attention, find_routers
from agent.discovery.controls import control_label, find_controls
from agent.testbed.model import MoETransformer, TestbedConfig


def test_test_bed_controls_are_values_output_and_the_first_expert():
    model = MoETransformer(TestbedConfig())
    sites, routers = find_attention(model), find_routers(model)
    controls = find_controls(model, sites[1], routers)
    assert [control_label(sites[1], n) for n in controls] == [
        "attn.v_proj.weight",
        "attn.o_proj.weight",
        "moe.experts.0.up_proj.weight",
        "moe.experts.0.down_proj.weight",
    ]
    assert all(p.dim() == 2 for p in controls.values())
    assert find_controls(model, sites[0], routers, limit=2).keys() == {
        "blocks.0.attn.v_proj.weight",
        "blocks.0.attn.o_proj.weight",
    }
    assert find_controls(model, sites[0], routers, limit=0) == {}


class _Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_heads = 2
        self.qkv_proj = nn.Linear(8, 24)
        self.out_proj = nn.Linear(8, 8)


class _MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)  # a router: never a control
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Fused()
        self.moe = _MoE()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))


def test_a_fused_qkv_weight_and_routers_are_never_controls():
    model = nn.ModuleDict({"block": _Block()})
    (site,) = find_attention(model)
    routers = find_routers(model)
    assert [r.name for r in routers] == ["block.moe.gate"]
    controls = find_controls(model, site, routers, limit=8)
    assert [control_label(site, n) for n in controls] == [
        "attn.out_proj.weight",
        *(f"moe.experts.{i}.weight" for i in range(4)),
        "mlp.0.weight",
        "mlp.2.weight",
    ]
