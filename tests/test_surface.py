"""The public surface: what ``import splitkv`` offers, and entries that take the one option list.

The options are declared once (:mod:`splitkv.options`); each entry either takes them as keywords
(and builds :class:`~splitkv.options.VerifyOptions` from them) or, for the drop-in, as
``extend_attention_fwd``'s positional arguments. These tests derive what each entry must take
from that declaration.
"""

import inspect

import pytest

import splitkv
from splitkv import can_handle, decline_reason, extend_attention_fwd, verify_attention, verify_splitkv_fwd
from splitkv.options import METADATA, OPTION_NAMES, TENSORS, VerifyOptions, option_names, split_options
from splitkv.ops import VERIFY_SCHEMA

def _params(fn):
    return list(inspect.signature(fn).parameters.values())


def test_the_drop_in_takes_extend_attention_fwds_arguments_in_its_order_and_every_option():
    base = _params(extend_attention_fwd)
    mine = _params(verify_splitkv_fwd)
    assert [p.name for p in mine[: len(base)]] == [p.name for p in base]
    assert [p.name for p in base[:9]] == list(TENSORS)
    # Every option (but return_lse: the drop-in writes no LSE) and every metadata tensor, by name.
    assert {p.name for p in mine[9:]} == set(option_names()) - {"return_lse"}
    # Keyword defaults agree with extend_attention_fwd's and with the option list's.
    defaults = VerifyOptions._field_defaults
    for p, b in zip(mine, base):
        if p.default is not inspect.Parameter.empty:
            assert p.default == b.default, p.name
            if p.name in defaults:
                assert p.default == defaults[p.name], p.name


def test_keyword_entries_take_the_tensors_then_the_option_list():
    for fn in (verify_attention, decline_reason, can_handle):
        params = _params(fn)
        names = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        assert names == [n for n in TENSORS if n != "o_extend" or fn is verify_attention], fn.__name__
        assert params[-1].kind is inspect.Parameter.VAR_KEYWORD, fn.__name__


def test_the_custom_ops_schema_is_the_option_list():
    for name in list(TENSORS[:3]) + list(TENSORS[4:]) + list(option_names()):
        assert f" {name}" in VERIFY_SCHEMA, name
    assert "o_extend" not in VERIFY_SCHEMA
    # Same order as declared: the keyword part lists the options in declaration order.
    keywords = VERIFY_SCHEMA.split("*, ")[1]
    order = [k.split()[1].split("=")[0] for k in keywords.split(") ->")[0].split(", ")]
    assert order == list(OPTION_NAMES)


def test_split_options_takes_exactly_the_option_list():
    opts, meta = split_options({"max_len_extend": 4, "sinks": None, "is_causal": False})
    assert opts == VerifyOptions(4, is_causal=False) and set(meta) == set(METADATA)
    with pytest.raises(TypeError):
        split_options({"max_len_extend": 4, "not_an_option": 1})


@pytest.mark.parametrize("bad, error", [
    (dict(is_causal=1), "is_causal must be a bool"),
    (dict(check="yes"), "check must be one of"),
    (dict(check=1), "check must be one of"),
    (dict(max_len_extend=4.0), "max_len_extend must be an int"),
])
def test_options_that_an_equal_value_of_another_type_would_hide_raise_type_errors(bad, error):
    with pytest.raises(TypeError, match=error):
        VerifyOptions(**{"max_len_extend": 4, **bad}).checked()


def test_options_are_immutable_and_hashable():
    opts = VerifyOptions(4)
    with pytest.raises(AttributeError):
        opts.is_causal = False
    assert hash(opts) == hash(VerifyOptions(4)) and opts != VerifyOptions(4, is_causal=False)


def test_top_level_namespace_is_the_production_api():
    assert set(splitkv.__all__) <= set(dir(splitkv))
    for name in ("make_problem", "reference_for", "MODEL_SHAPES", "relative_error"):
        assert name not in splitkv.__all__ and not hasattr(splitkv, name)
        assert hasattr(splitkv.testing, name)
