"""Lab 04 (FlashAttention): the online-softmax step, the tiles a causal kernel may skip, and
Flash-Decoding's merge of split-KV partial results.

The references are the engine's own: the online softmax one key tile at a time
(`workbench.attention.flash_reference.online_softmax_steps`, the loop of `_attend_tiles` in
`kernels/flash_attention.py` in plain PyTorch) and, for its final answer, attention the obvious way
(`kernels/reference.py: attention_reference`); the kernel's tile plan
(`workbench.attention.flash_reference.tile_map`, the bounds `_flash_attention_fwd` computes); and the split-KV merge
(`workbench.attention.flash_reference.merge_partials`, phase 2 of `kernels/paged_decode.py`), with the split
partials from `split_partials`.
"""
from __future__ import annotations

import torch

from workbench.kernels.reference import attention_reference

from workbench.attention.flash_reference import (FULL, MASKED, SKIP, merge_partials, online_softmax_steps,
                                          split_partials, tile_map)
from workbench.course.labs.core import Mismatch, call, exercise

CHAPTER = "04_flash_attention"


def _tensor(got, what: str, name: str, shape: tuple) -> torch.Tensor:
    """The learner's tensor, or a Mismatch naming what is wrong with its type or shape."""
    if not isinstance(got, torch.Tensor):
        raise Mismatch(f"{what}: {name} should be a torch.Tensor, got {type(got).__name__}")
    if not got.is_floating_point():
        raise Mismatch(f"{what}: {name} should be a float tensor, got {got.dtype}")
    if tuple(got.shape) != tuple(shape):
        raise Mismatch(f"{what}: {name} should have shape {tuple(shape)}, got {tuple(got.shape)}")
    return got.detach().cpu().double()


def _close(a: torch.Tensor | None, b: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-5) -> bool:
    """allclose that treats equal infinities as equal and any NaN as different."""
    if a is None or a.shape != b.shape or torch.isnan(a).any() or torch.isnan(b).any():
        return False
    return bool(torch.allclose(a.double(), b.double(), atol=atol, rtol=rtol))


def _largest(got: torch.Tensor, expected: torch.Tensor) -> str:
    if torch.isnan(got).any() or torch.isinf(got).any():
        return "it holds NaN or inf"
    err = (got.double() - expected.double()).abs()
    idx = tuple(int(i) for i in (err == err.max()).nonzero()[0])
    return (f"largest difference {err.max().item():.3g} at {list(idx)}: expected "
            f"{expected[idx].item():.6g}, got {got[idx].item():.6g}")


# -------------------------------------------------------------------------- online softmax
def _attention_case(rows: int, keys: int, dim: int, seed: int, causal: bool = False,
                    scale_up: float = 1.0, hot: tuple[int, int] | None = None):
    """q (rows, D), k and v (keys, D), and the scores the kernel computes, q k^T / sqrt(D), with
    the causal mask aligned bottom-right (query i sits at position i + keys - rows)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, dim, generator=gen)
    k = torch.randn(keys, dim, generator=gen) * scale_up
    v = torch.randn(keys, dim, generator=gen)
    if hot is not None:                 # row hot[0] finds its largest score late, at key hot[1]
        k[hot[1]] = q[hot[0]] * 1.5
    scores = q @ k.T * dim ** -0.5
    if causal:
        hidden = torch.arange(keys)[None, :] > torch.arange(rows)[:, None] + (keys - rows)
        scores = scores.masked_fill(hidden, float("-inf"))
    return q, k, v, scores


def _update_variants(m, l, acc, s, v):
    """Typical wrong updates from the same state (only to recognise a mistake)."""
    m_new = torch.maximum(m, s.max(dim=1).values)
    p = torch.exp(s - m_new[:, None])
    alpha = torch.exp(m - m_new)
    right_l = l * alpha + p.sum(1)
    right_acc = acc * alpha[:, None] + p @ v
    return {
        "acc not rescaled": (m_new, right_l, acc + p @ v),
        "l not rescaled": (m_new, l + p.sum(1), right_acc),
        "alpha inverted": (m_new, l * torch.exp(m_new - m) + p.sum(1),
                           acc * torch.exp(m_new - m)[:, None] + p @ v),
        "acc normalized": (m_new, right_l, right_acc / right_l[:, None]),
    }


_UPDATE_HINTS = {
    "acc not rescaled": ("when the running max grows, the old terms of acc were computed against "
                         "the old max: multiply acc by alpha = exp(m - m_new) too, not only l."),
    "l not rescaled": ("when the running max grows, the old sum l was computed against the old "
                       "max: l_new = alpha * l + sum(exp(s - m_new)), with alpha = "
                       "exp(m - m_new)."),
    "alpha inverted": ("alpha = exp(m_old - m_new), which is <= 1: the old terms shrink, never "
                       "grow."),
    "acc normalized": ("keep acc unnormalized (sum of exp(s - m) * v); dividing by l happens once, "
                       "after the last tile."),
}


@exercise("flash.online_softmax_update", CHAPTER, "online_softmax_update",
          "one tile of the online softmax: running max, running sum, output accumulator",
          hint="m_new = max(m, row max of s); p = exp(s - m_new); alpha = exp(m - m_new); "
               "l = alpha * l + p.sum(1); acc = alpha * acc + p @ v; return (m_new, l, acc).")
def check_online_softmax_update(online_softmax_update) -> None:
    cases = [  # (label, rows, keys, dim, tile, causal, scale_up, hot, seed)
        ("4 queries, 32 keys in tiles of 8; row 0's largest score is in tile 2",
         4, 32, 16, 8, False, 1.0, (0, 21), 0),
        ("one tile holding every key", 3, 8, 8, 8, False, 1.0, None, 1),
        ("a ragged last tile (10 keys in tiles of 4)", 3, 10, 8, 4, False, 1.0, None, 2),
        ("causal, 12 queries and 12 keys in tiles of 4: masked (-inf) scores, and rows whose "
         "whole tile is masked", 12, 12, 8, 4, True, 1.0, None, 3),
        ("causal chunk: 5 new queries after 11 cached keys, tiles of 4", 5, 16, 8, 4, True, 1.0,
         None, 4),
        ("large scores (up to about 300): exp overflows float32 past 88", 4, 24, 16, 8, False, 60.0,
         None, 5),
        ("16 queries, 64 keys in tiles of 16", 16, 64, 32, 16, True, 1.0, (3, 50), 6),
    ]
    for label, rows, keys, dim, tile, causal, scale_up, hot, seed in cases:
        q, k, v, scores = _attention_case(rows, keys, dim, seed, causal, scale_up, hot)
        steps = online_softmax_steps(scores, v, tile)          # the engine's loop, tile by tile
        m = torch.full((rows,), float("-inf"))
        l = torch.zeros(rows)
        acc = torch.zeros(rows, dim)
        for st in steps:
            s, v_tile = scores[:, st.start:st.end], v[st.start:st.end]
            what = (f"case '{label}', tile {st.tile} (keys {st.start}-{st.end - 1}): "
                    f"online_softmax_update(m, l, acc, s, v) with s of shape {tuple(s.shape)}")
            got = call(online_softmax_update, what, m.clone(), l.clone(), acc.clone(), s.clone(),
                       v_tile.clone())
            if not isinstance(got, (tuple, list)) or len(got) != 3:
                raise Mismatch(f"{what} returned {type(got).__name__}: expected a tuple "
                               "(m, l, acc)")
            g_m = _tensor(got[0], what, "m", (rows,))
            g_l = _tensor(got[1], what, "l", (rows,))
            g_acc = _tensor(got[2], what, "acc", (rows, dim))
            ok = (_close(g_m, st.m, atol=1e-6) and _close(g_l, st.l) and _close(g_acc, st.acc))
            if not ok:
                _explain_update(what, (g_m, g_l, g_acc), st, m, l, acc, s, v_tile, scores)
            m, l, acc = g_m.float(), g_l.float(), g_acc.float()
        out = acc / l[:, None]
        want = attention_reference(q[None, None], k[None, None], v[None, None], causal=causal)[0, 0]
        if not _close(out, want, atol=1e-5):
            raise Mismatch(f"case '{label}': after the last tile acc / l is not attention's output "
                           f"(kernels/reference.py): {_largest(out, want)}")


def _explain_update(what, got, st, m, l, acc, s, v_tile, scores) -> None:
    g_m, g_l, g_acc = got
    has_nan = any(torch.isnan(t).any() or torch.isinf(t).any() for t in got[1:])
    masked_rows = torch.isinf(s).all(dim=1) & (s < 0).all(dim=1)
    hint = ""
    if has_nan:
        if masked_rows.any() and (torch.isnan(g_l[masked_rows]).any()
                                  or torch.isnan(g_acc[masked_rows]).any()):
            hint = ("a row whose scores in this tile are all -inf (masked by the causal mask) must "
                    "keep its state: exp(s - m_new) is 0 there as long as you subtract the running "
                    "max m_new, never the tile's own max (-inf - -inf is NaN).")
        elif s[torch.isfinite(s)].abs().max() > 80:
            hint = ("NaN or inf: exp of a large score overflows float32. Subtract the running max "
                    "before exp: p = exp(s - m_new).")
        elif torch.isinf(m).all() and st.tile == 0:
            hint = ("on the first tile m is -inf: alpha = exp(m - m_new) is then 0 (the empty "
                    "state contributes nothing); exp(m_new - m) would be inf.")
    if not hint:
        for name, (vm, vl, vacc) in _update_variants(m, l, acc, s, v_tile).items():
            if _close(g_m, vm, atol=1e-6) and _close(g_l, vl) and _close(g_acc, vacc):
                hint = _UPDATE_HINTS[name]
                break
    if not hint and not _close(g_m, st.m, atol=1e-6):
        if _close(g_m, s.max(dim=1).values, atol=1e-6):
            hint = ("m is the max over every key seen so far: max(m, max of this tile), not the "
                    "tile's max alone.")
        else:
            hint = "m_new = maximum(m, s.max(dim=1)): the running max of each row."
    if not hint and _close(g_l, torch.exp(scores[:, :st.end]).sum(1).float()):
        hint = ("l and acc are kept relative to the running max: l = sum(exp(s - m)), not "
                "sum(exp(s)) (which overflows for large scores).")
    parts = []
    for name, g, e in (("m", g_m, st.m), ("l", g_l, st.l), ("acc", g_acc, st.acc)):
        if not _close(g, e, atol=1e-6 if name == "m" else 1e-5):
            parts.append(f"\n  {name}: {_largest(g, e)}")
    raise Mismatch(what + ":" + "".join(parts), hint)


# ------------------------------------------------------------------------------ tile plan
NAMES = {SKIP: "skip", MASKED: "masked", FULL: "full"}


def _classify(q_len, kv_len, bm, bn, shift=None, ragged_full=False, skip_rule="last",
              full_rule="first", causal=True):
    """A tile plan derived from the mask, with switches for typical mistakes (only to recognise
    them; the reference is the engine's tile_map)."""
    shift = kv_len - q_len if shift is None else shift
    plan = []
    for m0 in range(0, q_len, bm):
        last = min(m0 + bm, q_len) - 1
        row_skip = last if skip_rule == "last" else m0
        row_full = m0 if full_rule == "first" else last
        row = []
        for n0 in range(0, kv_len, bn):
            n_last = min(n0 + bn, kv_len) - 1
            whole = n0 + bn <= kv_len or ragged_full
            if causal and n0 > row_skip + shift:
                row.append("skip")
            elif (not causal or n_last <= row_full + shift) and whole:
                row.append("full")
            else:
                row.append("masked")
        plan.append(row)
    return plan


def _tile_text(q_len, kv_len, bm, bn, i, j) -> str:
    r0, r1 = i * bm, min((i + 1) * bm, q_len) - 1
    c0, c1 = j * bn, min((j + 1) * bn, kv_len) - 1
    shift = kv_len - q_len
    ragged = (f"; the tile runs to {(j + 1) * bn - 1}, past kv_len = {kv_len}"
              if (j + 1) * bn > kv_len else "")
    return (f"query tile {i} (rows {r0}-{r1}, at positions {r0 + shift}-{r1 + shift}) against key "
            f"tile {j} (keys {c0}-{c1}{ragged})")


@exercise("flash.tile_plan", CHAPTER, "tile_plan",
          "which (query tile, key tile) pairs a causal kernel computes, with or without the mask",
          hint="query row i sits at position i + kv_len - q_len and sees keys 0..that position. "
               "A tile is 'skip' if even its last query row sees none of its keys, 'full' if even "
               "its first query row sees all of them and the tile lies wholly before kv_len, "
               "'masked' otherwise.")
def check_tile_plan(tile_plan) -> None:
    cases = [(8, 8, 4, 4), (200, 200, 16, 16), (77, 77, 16, 16), (17, 17, 16, 16),
             (64, 192, 16, 16), (40, 100, 16, 16), (20, 70, 16, 16), (5, 5, 16, 16), (1, 9, 4, 4),
             (33, 33, 32, 16), (16, 50, 8, 32), (130, 400, 128, 64), (300, 300, 128, 64)]
    for q_len, kv_len, bm, bn in cases:
        what = f"tile_plan(q_len={q_len}, kv_len={kv_len}, block_m={bm}, block_n={bn})"
        got = call(tile_plan, what, q_len, kv_len, bm, bn)
        expected = [[NAMES[c] for c in row] for row in tile_map(q_len, kv_len, bm, bn, causal=True)]
        if not isinstance(got, (list, tuple)) or not all(isinstance(r, (list, tuple)) for r in got):
            raise Mismatch(f"{what} returned {type(got).__name__}: expected a list with one list "
                           f"per query tile ({len(expected)} of them)")
        got = [list(r) for r in got]
        if len(got) != len(expected) or any(len(r) != len(expected[0]) for r in got):
            shape = f"{len(got)} rows of lengths {sorted({len(r) for r in got})}"
            raise Mismatch(f"{what}: expected {len(expected)} query tiles (rows) of "
                           f"{len(expected[0])} key tiles each, got {shape}",
                           "one row per query tile, ceil(q_len / block_m) of them; one entry per "
                           "key tile, ceil(kv_len / block_n): a ragged last tile counts.")
        bad = [x for r in got for x in r if x not in ("skip", "masked", "full")]
        if bad:
            raise Mismatch(f"{what}: entries must be 'skip', 'masked' or 'full', got {bad[0]!r}")
        if got == expected:
            continue
        i, j = next((i, j) for i, r in enumerate(expected) for j, x in enumerate(r)
                    if got[i][j] != x)
        hint = ""
        if got == _classify(q_len, kv_len, bm, bn, shift=0):
            hint = ("the causal mask is aligned bottom-right: with fewer queries than keys, query "
                    "i sits at position i + kv_len - q_len (the cached keys are all visible).")
        elif got == _classify(q_len, kv_len, bm, bn, ragged_full=True):
            hint = ("a key tile that runs past kv_len needs the mask for the length (its loads and "
                    "scores past the end must be masked), even if every real key in it is visible.")
        elif got == _classify(q_len, kv_len, bm, bn, skip_rule="first"):
            hint = ("a tile may be skipped only if even the *last* query row of the tile sees none "
                    "of its keys: later rows see further.")
        elif got == _classify(q_len, kv_len, bm, bn, full_rule="last"):
            hint = ("a tile runs without the mask only if even the *first* query row of the tile "
                    "sees all of its keys.")
        elif got == _classify(q_len, kv_len, bm, bn, causal=False):
            hint = ("this is the plan without a causal mask; here every query sees only keys up "
                    "to its position.")
        raise Mismatch(f"{what}: {_tile_text(q_len, kv_len, bm, bn, i, j)} should be "
                       f"{expected[i][j]!r}, got {got[i][j]!r}", hint)


# ------------------------------------------------------------------------------ split merge
@exercise("flash.merge_partials", CHAPTER, "merge_partials",
          "Flash-Decoding's merge of split-KV partial outputs by their log-sum-exp",
          hint="weights w_s = exp(lse_s - max over s of lse_s), normalized to sum 1 over the "
               "splits; out = sum over s of w_s * out_s.")
def check_merge_partials(merge_partials_fn) -> None:
    cases = [  # (label, rows, keys, dim, split_len, scale_up, hot, seed)
        ("1 query row, 200 keys in splits of 64 (the last holds 8); keys 120-127 dominate",
         1, 200, 16, 64, 1.0, (0, range(120, 128)), 0),
        ("a single split", 2, 40, 8, 64, 1.0, None, 1),
        ("3 query rows, 5 splits of 16 keys, the last of 7", 3, 71, 8, 16, 1.0, None, 2),
        ("large scores: every lse around +300 (exp overflows float32 past 88)", 2, 48, 8, 16, 4.0,
         None, 3),
        ("8 query rows, 256 keys in splits of 32", 8, 256, 32, 32, 1.0, None, 4),
    ]
    prepared = []
    for label, rows, keys, dim, split_len, scale_up, hot, seed in cases:
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(rows, dim, generator=gen)
        k = torch.randn(keys, dim, generator=gen)
        v = torch.randn(keys, dim, generator=gen)
        if hot is not None:
            for key in hot[1]:
                k[key] = q[hot[0]] * 0.9 + 0.1 * torch.randn(dim, generator=gen)
        scale = dim ** -0.5 * scale_up
        scores = q @ k.T * scale
        if scale_up > 1:        # shift every score up (softmax does not change), so lse ~ 300
            scores = scores - scores.max() + 300
        outs, lse, _ = split_partials(scores, v, split_len)    # the engine's phase 1
        exact = scores.softmax(dim=-1) @ v
        if scale_up == 1:       # tie the exact answer to the reference attention too
            ref = attention_reference(q[None, None], k[None, None], v[None, None], causal=False,
                                      sm_scale=scale)[0, 0]
            assert torch.allclose(ref, exact, atol=1e-5)
        prepared.append((label, outs, lse, exact))
    # A split that got no keys (the kernel's last programs when the context is short): its
    # output is 0 and its lse -inf, so it must get no weight.
    label, outs, lse, exact = prepared[1]
    prepared.insert(2, ("a single split, then an empty one (output 0, lse -inf)",
                        torch.cat([outs, torch.zeros_like(outs[:1])]),
                        torch.cat([lse, torch.full_like(lse[:1], float("-inf"))]), exact))
    # Very negative lse: exp underflows to 0 unless the max is subtracted first.
    label, outs, lse, exact = prepared[3]
    prepared.insert(5, ("very negative scores: every lse around -300 (exp underflows to 0)",
                        outs, lse - 600, exact))
    for label, outs, lse, exact in prepared:
        rows, dim = outs.shape[1:]
        what = (f"case '{label}': merge_partials(outs of shape {tuple(outs.shape)}, lse of shape "
                f"{tuple(lse.shape)})" + (f", lse = {_fmt_lse(lse)}" if lse.numel() <= 8 else ""))
        got = call(merge_partials_fn, what, outs.clone(), lse.clone())
        if isinstance(got, (tuple, list)):
            raise Mismatch(f"{what} returned a {type(got).__name__}: return only the merged "
                           f"output, a tensor of shape {(rows, dim)}")
        got = _tensor(got, what, "the merged output", (rows, dim))
        expected = merge_partials(outs, lse)[0]                 # the engine's phase 2
        if _close(got, expected, atol=1e-5) and _close(got, exact, atol=1e-4):
            continue
        raise Mismatch(f"{what}: {_largest(got, expected)}", _merge_hint(got, outs, lse))


def _fmt_lse(lse: torch.Tensor) -> str:
    return "[" + ", ".join("[" + ", ".join(f"{x:.4g}" for x in row) + "]"
                           for row in lse.tolist()) + "]"


def _merge_hint(got, outs, lse) -> str:
    finite = torch.isfinite(lse)
    if torch.isnan(got).any() or torch.isinf(got).any():
        if (~finite).any():
            return ("an empty split has lse = -inf and must get weight 0: exp(-inf - max) is 0. "
                    "Subtract the max over the splits (not over rows) before exp.")
        return ("NaN or inf: exp(lse) overflows or underflows for large |lse|. Subtract the max "
                "over the splits first: w = exp(lse - lse.max(dim=0).values), then normalize.")
    o = outs.double()
    l = lse.double()
    variants = {
        "mean": (o.mean(0), "a plain average treats every split alike; weight each split by "
                            "its share of the softmax mass, exp(lse_s) / sum over splits of "
                            "exp(lse)."),
        "linear": ((o * (l / l.sum(0))[..., None]).sum(0),
                   "the weights are exp(lse_s), normalized: lse is a logarithm of the mass."),
        "unnormalized": ((o * torch.exp(l - l.max(0).values)[..., None]).sum(0),
                         "divide by the sum of the weights: they must add up to 1 over the "
                         "splits."),
        "rows": ((o * torch.softmax(l, dim=1)[..., None]).sum(0),
                 "normalize over the splits (dim 0), not over the query rows: each row is "
                 "merged on its own."),
        "argmax": (o.gather(0, l.argmax(0)[None, :, None].expand(1, *o.shape[1:]))[0],
                   "every split contributes, by its weight, not only the one with the largest "
                   "lse."),
    }
    for value, hint in variants.values():
        if _close(got, value, atol=1e-5):
            return hint
    return ""
