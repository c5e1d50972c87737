import pytest

from rollout import SamplingParams


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("n", 0), ("top_k", -2), ("min_p", 2.0),
     ("max_new_tokens", 0), ("stop", [""]), ("stop_token_ids", [-1]), ("seed", 1.5)],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_unknown_fields_are_rejected_by_name():
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 1.0})


def test_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]


def test_every_list_of_sampling_parameters_comes_from_sampling_params():
    """One list per meaning: the server's checks, OpenAI's fields and `rollout generate`'s flags (with
    SamplingParams' defaults) are made from its fields."""
    from dataclasses import fields

    from rollout.server.guard import _SAMPLING_TYPES
    from rollout.server.openai_routes import SAMPLING
    from rollout.tools.cli import build_parser

    names = {f.name for f in fields(SamplingParams)}
    assert names <= set(_SAMPLING_TYPES)
    assert SAMPLING == names - {"max_new_tokens", "min_new_tokens"} | {"min_tokens"}
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert SamplingParams.from_args(args) == SamplingParams()
    args = build_parser().parse_args(["generate", "--prompt", "x", "--sample-seed", "5", "--stop", "a", "--stop", "b",
                                      "--no-skip-special-tokens", "--top-k", "3", "--seed", "9"])
    assert SamplingParams.from_args(args) == SamplingParams(seed=5, stop=["a", "b"], skip_special_tokens=False, top_k=3)
    assert args.seed == 9  # (the engine's --seed stays the engine's)
