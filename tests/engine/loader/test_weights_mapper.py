"""WeightsMapper: prefix/regex/suffix rules, drops, pass-through and `|` chaining order."""

from engine.loader.weights_mapper import WeightsMapper


def test_unknown_name_passes_through_unchanged():
    mapper = WeightsMapper(orig_to_new_prefix={"a.": "b."}, orig_to_new_regex=[(r"^x$", "y")])
    assert mapper.map_name("model.norm.weight") == "model.norm.weight"
    assert WeightsMapper().map_name("anything") == "anything"


def test_prefix_rule_replaces_only_the_prefix():
    mapper = WeightsMapper(orig_to_new_prefix={"token_embd.": "model.embed_tokens."})
    assert mapper.map_name("token_embd.weight") == "model.embed_tokens.weight"
    assert mapper.map_name("x.token_embd.weight") == "x.token_embd.weight"


def test_first_matching_prefix_wins():
    mapper = WeightsMapper(orig_to_new_prefix={"output.": "lm_head.", "output": "never."})
    assert mapper.map_name("output.weight") == "lm_head.weight"


def test_regex_rule_substitutes_groups():
    mapper = WeightsMapper(orig_to_new_regex=[(r"^blk\.(\d+)\.attn_q\.", r"model.layers.\1.self_attn.q_proj.")])
    assert mapper.map_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    # attn_q must not swallow attn_q_norm
    assert mapper.map_name("blk.12.attn_q_norm.weight") == "blk.12.attn_q_norm.weight"


def test_only_the_first_matching_regex_applies():
    mapper = WeightsMapper(orig_to_new_regex=[(r"^a", "b"), (r"^b", "c")])
    assert mapper.map_name("a.w") == "b.w"  # not chained into "c.w"


def test_suffix_rule():
    mapper = WeightsMapper(orig_to_new_suffix={".gamma": ".weight"})
    assert mapper.map_name("norm.gamma") == "norm.weight"


def test_rule_kinds_apply_in_order_prefix_regex_suffix():
    mapper = WeightsMapper(
        orig_to_new_prefix={"m.": "model."},
        orig_to_new_regex=[(r"^model\.l(\d+)\.", r"model.layers.\1.")],
        orig_to_new_suffix={".g": ".weight"},
    )
    assert mapper.map_name("m.l3.norm.g") == "model.layers.3.norm.weight"


def test_none_drops_the_tensor_for_every_rule_kind():
    mapper = WeightsMapper(
        orig_to_new_prefix={"rope_freqs.": None},
        orig_to_new_regex=[(r"\.rotary_emb\.inv_freq$", None)],
        orig_to_new_suffix={".scratch": None},
    )
    assert mapper.map_name("rope_freqs.weight") is None
    assert mapper.map_name("model.layers.0.self_attn.rotary_emb.inv_freq") is None
    assert mapper.map_name("a.scratch") is None
    assert mapper.map_name("model.norm.weight") == "model.norm.weight"


def test_or_applies_left_then_right():
    left = WeightsMapper(orig_to_new_prefix={"a.": "b."})
    right = WeightsMapper(orig_to_new_prefix={"b.": "c."})
    assert (left | right).map_name("a.w") == "c.w"  # right sees left's output
    assert (right | left).map_name("a.w") == "b.w"  # right first: no match, then left
    assert (right | left).map_name("b.w") == "c.w"


def test_or_drops_when_either_side_drops():
    drop_b = WeightsMapper(orig_to_new_prefix={"b.": None})
    a_to_b = WeightsMapper(orig_to_new_prefix={"a.": "b."})
    assert (a_to_b | drop_b).map_name("a.w") is None
    assert (drop_b | a_to_b).map_name("b.w") is None
    assert (drop_b | a_to_b).map_name("a.w") == "b.w"


def test_or_is_associative_and_leaves_operands_unchanged():
    m1 = WeightsMapper(orig_to_new_prefix={"a.": "b."})
    m2 = WeightsMapper(orig_to_new_prefix={"b.": "c."})
    m3 = WeightsMapper(orig_to_new_suffix={".w": ".weight"})
    assert ((m1 | m2) | m3).map_name("a.w") == (m1 | (m2 | m3)).map_name("a.w") == "c.weight"
    assert m1.map_name("a.w") == "b.w" and m1.then is None
