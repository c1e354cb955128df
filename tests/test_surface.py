"""The public surface: what ``import splitkv`` offers, and entry points that must agree.

The extend-style argument list is written out in each entry that takes it
(the drop-in contract wants it positional and explicit); these tests keep the
copies from drifting apart.
"""

import inspect

import splitkv
from splitkv import can_handle, decline_reason, extend_attention_fwd, verify_attention, verify_splitkv_fwd


def _params(fn):
    return list(inspect.signature(fn).parameters.values())


def test_entries_take_extend_attention_fwds_arguments_in_its_order():
    """The drop-in takes extend_attention_fwd's arguments in its order; verify_attention takes its tensors
    up to kv_indices in that order, then every other argument as a keyword of the same name."""
    base = _params(extend_attention_fwd)
    empty = inspect.Parameter.empty
    mine = _params(verify_splitkv_fwd)[: len(base)]
    assert [p.name for p in mine] == [p.name for p in base], "verify_splitkv_fwd"
    # Keyword defaults agree (the drop-in requires k_scale and v_scale, as SGLang's kernel does).
    for p, b in zip(mine, base):
        if p.name not in ("k_scale", "v_scale") and p.default is not empty:
            assert p.default == b.default, ("verify_splitkv_fwd", p.name)
    entry = _params(verify_attention)
    assert [p.name for p in entry[:9]] == [b.name for b in base[:9]], "verify_attention"
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in entry[:9])
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in entry[9:])
    keywords = {p.name: p for p in entry[9:]}
    for b in base[9:]:
        assert b.name in keywords, ("verify_attention", b.name)
        p = keywords[b.name]
        if p.name not in ("k_scale", "v_scale") and b.default is not empty:
            assert p.default == b.default, ("verify_attention", p.name)


def test_gate_functions_share_their_arguments():
    reason = _params(decline_reason)
    handle = _params(can_handle)
    # can_handle names the tensors and max_len_extend and passes every other keyword on to decline_reason.
    assert [(p.name, p.kind) for p in handle[:-1]] == [(p.name, p.kind) for p in reason[: len(handle) - 1]]
    assert handle[-1].kind is inspect.Parameter.VAR_KEYWORD
    # The gate takes the drop-in's arguments (the output included, as a keyword) and its options, but check.
    drop_in = {p.name for p in _params(verify_splitkv_fwd)} - {"check"}
    assert {p.name for p in reason} == drop_in
    # Everything after kv_indices is a keyword, named as verify_attention names it.
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in reason[8:])
    assert {p.name for p in reason} <= {p.name for p in _params(verify_attention)}


def test_top_level_namespace_is_the_production_api():
    assert set(splitkv.__all__) <= set(dir(splitkv))
    for name in ("make_problem", "reference_for", "MODEL_SHAPES", "relative_error"):
        assert name not in splitkv.__all__ and not hasattr(splitkv, name)
        assert hasattr(splitkv.testing, name)
