"""Which rank measures what: the monitor work spread over the ranks, about 1/world each.

- query head ``h`` of the ``i``-th attention layer: the rank that holds its rows when the
  layer's Q and K weights are sharded by rows across the ranks with every head and its KV
  head on one rank (``fetch.head_owners``: tensor-parallel heads, FSDP2 shards that fall on
  head boundaries): each rank measures its local heads, nothing moves (with a window of
  ``heads_per_layer`` < H heads, one evaluation may then fall on fewer ranks; balanced over
  ceil(H / heads_per_layer) visits); otherwise rank
  ``(i * H + h) % world``, round robin over the global head index, so that every evaluation
  (all heads of a few layers, or a rotating window of heads) is spread over the ranks, on any
  number of ranks (``(i + h) % world``, the earlier rule, used only the first L + H - 1 ranks:
  a 70B model on 1024 ranks had a slowest rank 12x the even share); the head's KV factor comes
  with it;
- the ``i``-th layer's control matrices (values, output projection, MLP): rank ``i % world``;
- the ``j``-th router's weight statistics (conditioning ratio, similarity): rank
  ``j % world``; the routing sums are every rank's own (each rank routes its own tokens) and
  are summed over the ranks.

The assignment is fixed for the whole run: the rank that measures a head keeps that head's
Delta_2 direction for the persistence metric. ``rows_needed`` says which rows of which
parameter a rank's share of a layer needs: all that is fetched of a sharded weight.
"""

from __future__ import annotations

from agent.discovery import AttentionSite
from agent.discovery.sites import HeadSlices

# What a rank needs of one parameter: None (every row), or the sorted rows of dim 0 (an empty
# list: nothing).
Need = list[int] | None


def head_rank(
    layer: int, head: int, num_heads: int, world: int, owners: list[int] | None = None
) -> int:
    """The rank that measures query head ``head`` of the ``layer``-th attention layer, which
    has ``num_heads`` query heads (``owners``: the rank holding each head's rows, when they
    are local to one rank)."""
    return owners[head] if owners is not None else (layer * num_heads + head) % world


def control_rank(layer: int, world: int) -> int:
    return layer % world


def router_rank(router: int, world: int) -> int:
    return router % world


def heads_of(
    layer: int, num_heads: int, rank: int, world: int, owners: list[int] | None = None
) -> list[int]:
    """The query heads of the ``layer``-th attention layer that ``rank`` measures."""
    return [h for h in range(num_heads) if head_rank(layer, h, num_heads, world, owners) == rank]


def rows_needed(
    site: AttentionSite,
    layer: int,
    rank: int,
    world: int,
    controls: list[str],
    owners: list[int] | None = None,
) -> dict[str, Need]:
    """Parameter name -> the rows ``rank`` needs of it to measure its heads of ``site`` (the
    ``layer``-th attention layer) and, when it owns them, the layer's ``controls``; names it
    needs nothing of are left out."""
    heads = heads_of(layer, site.num_heads, rank, world, owners)
    rows: dict[str, set[int] | None] = {}
    if heads:
        kv = sorted({site.kv_head(h) for h in heads})
        _add_heads(rows, site.q, heads, site.head_dim)
        _add_heads(rows, site.k, kv, site.head_dim)
        for name in site.parameters_to_snapshot():
            rows.setdefault(name, None)  # norm scales, latent first stages: whole
    if control_rank(layer, world) == rank:
        for name in controls:
            rows[name] = None
    return {name: None if need is None else sorted(need) for name, need in rows.items()}


def _add_heads(rows: dict[str, set[int] | None], spec: HeadSlices, heads: list[int], d_h: int):
    for name in (spec.norm_name, spec.latent and spec.latent.weight_name):
        if name:
            rows[name] = None
    if spec.latent is not None and spec.latent.norm_name:
        rows[spec.latent.norm_name] = None
    if spec.input_major:  # [d, out]: a head is a block of columns, every row is needed
        rows[spec.weight_name] = None
        return
    if spec.weight_name in rows and rows[spec.weight_name] is None:
        return
    wanted = rows.setdefault(spec.weight_name, set())
    assert wanted is not None
    for h in heads:
        wanted.update(range(spec.starts[h], spec.starts[h] + d_h))
