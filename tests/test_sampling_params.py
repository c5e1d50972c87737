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
