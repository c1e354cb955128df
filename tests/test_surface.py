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
    base = _params(extend_attention_fwd)
    for fn in (verify_splitkv_fwd, verify_attention):
        mine = _params(fn)[: len(base)]
        assert [p.name for p in mine] == [p.name for p in base], fn.__name__
        # Keyword defaults agree (the drop-in requires k_scale and v_scale, as SGLang's kernel does).
        for p, b in zip(mine, base):
            if p.name not in ("k_scale", "v_scale") and p.default is not inspect.Parameter.empty:
                assert p.default == b.default, (fn.__name__, p.name)


def test_gate_functions_share_their_arguments():
    gate_names = [p.name for p in _params(can_handle)]
    extra = ("max_bs", "split_tokens")
    assert [p.name for p in _params(decline_reason) if p.name not in extra] == gate_names
    # The gate takes the drop-in's arguments minus the output and the drop-in's own options.
    drop_in = {p.name for p in _params(verify_splitkv_fwd)} - {"check"}
    assert set(gate_names) | set(extra) == drop_in


def test_top_level_namespace_is_the_production_api():
    assert set(splitkv.__all__) <= set(dir(splitkv))
    for name in ("make_problem", "reference_for", "MODEL_SHAPES", "relative_error"):
        assert name not in splitkv.__all__ and not hasattr(splitkv, name)
        assert hasattr(splitkv.testing, name)
