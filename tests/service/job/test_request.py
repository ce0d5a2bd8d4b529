"""One schema for the compress options: the request dataclass, the CLI flags, the proto and the server
all agree, and a remote job gets the request's own defaults."""

import dataclasses
from pathlib import Path

import pytest

from compressor.errors import InputError
from service.api import compression_pb2 as pb
from service.api.wire import SUBMISSION_FIELDS, api_field, spec_from_proto, spec_to_proto, wire_option_names
from service.client import cli
from service.job.request import LOCAL_ONLY, MODES, REFERENCES, CompressRequest, request_from_spec

FIELDS = {f.name: f for f in dataclasses.fields(CompressRequest)}


def test_the_proto_carries_exactly_the_request_fields_but_the_documented_local_ones():
    top, options = wire_option_names()
    assert top.isdisjoint(options)
    assert top | options == set(FIELDS) - set(LOCAL_ONLY)
    assert set(LOCAL_ONLY) <= set(FIELDS) and all(reason for reason in LOCAL_ONLY.values())
    assert {fd.name for fd in pb.CompressRequest.DESCRIPTOR.fields} == top | set(SUBMISSION_FIELDS)
    assert {fd.name for fd in pb.CompressRequest.DESCRIPTOR.oneofs_by_name["mode"].fields} == set(MODES)
    assert set(REFERENCES) <= top


def test_every_field_is_documented_and_the_cli_has_a_flag_for_each_cli_field():
    assert all(f.metadata["help"] for f in FIELDS.values())
    parser = cli.build_parser()
    compress = parser._subparsers._group_actions[0].choices["compress"]
    dests = {a.dest for a in compress._actions}
    cli_fields = {name for name, f in FIELDS.items() if f.metadata["cli"]}
    assert cli_fields <= dests
    assert {"normalise", "home", "trust_remote_code"}.isdisjoint(dests)  # deliberately not flags
    # argparse never supplies a default of its own: an absent flag is the request's default
    assert all(a.default is None for a in compress._actions if a.dest in cli_fields)


def test_flags_build_the_same_request_as_the_dataclass_defaults(tmp_path):
    args = cli.build_parser().parse_args(["compress", "m.pt2", "--calibration", "c.npz", "--out", str(tmp_path),
                                          "--uniform-ratio", "0.3", "--mean", "0.5,0.5,0.5", "--shape", "batch=4",
                                          "--stream", "--method", "mp+"])
    request = CompressRequest(**cli.compress_options(args))
    assert request == CompressRequest(model="m.pt2", calibration=Path("c.npz"), out_dir=tmp_path, uniform_ratio=0.3,
                                      mean=(0.5, 0.5, 0.5), shape={"batch": 4}, stream=True, method="mp+")


def test_a_remote_request_round_trips_and_unset_options_take_the_request_defaults():
    minimal = pb.CompressRequest(model="/m", calibration="/c", target_speedup=1.5)
    spec = spec_from_proto(minimal)
    assert set(spec) <= {"model", "calibration", "target_speedup", "shape", "back_off", "stream", "decode_step",
                         "no_curves_cache", "no_accuracy_budget"}
    request = request_from_spec(spec, out_dir=Path("/o"))
    defaults = CompressRequest(model="/m", calibration=Path("/c"), out_dir=Path("/o"), target_speedup=1.5)
    assert request == defaults
    full = {"model": "/m", "calibration": "/c", "uniform_ratio": 0.25, "eval": "/e", "samples": 7, "seed": 3,
            "mean": (0.1, 0.2), "std": (0.3, 0.4), "shape": {"batch": 2, "sequence": 9}, "stream": True,
            "precision": "fp16", "accuracy_budget": 0.05, "back_off": True, "threads": 2, "min_width": 0.2}
    assert request_from_spec(spec_from_proto(spec_to_proto(full)), out_dir=Path("/o")) == \
        request_from_spec(full, out_dir=Path("/o"))


def _parsed(*flags: str) -> dict:
    args = cli.build_parser().parse_args(["compress", "m.pt2", "--calibration", "c.npz", "--out", "o",
                                          "--uniform-ratio", "0.3", *flags])
    return cli.compress_options(args)


def test_the_cli_takes_a_number_or_none_as_accuracy_budget(capsys):
    assert _parsed("--accuracy-budget", "0.05")["accuracy_budget"] == 0.05
    off = _parsed("--accuracy-budget", "none")
    assert off["no_accuracy_budget"] is True and "accuracy_budget" not in off
    assert CompressRequest(**off).no_accuracy_budget and CompressRequest(**off).accuracy_budget is None
    default = _parsed()
    assert "accuracy_budget" not in default and "no_accuracy_budget" not in default
    with pytest.raises(SystemExit):
        _parsed("--accuracy-budget", "lots")
    assert "expected a number or none, got 'lots'" in capsys.readouterr().err


def test_no_accuracy_budget_round_trips_on_the_wire():
    spec = {"model": "/m", "calibration": "/c", "uniform_ratio": 0.5, "no_accuracy_budget": True}
    message = pb.CompressRequest.FromString(spec_to_proto(spec).SerializeToString())
    assert message.no_accuracy_budget and not message.HasField("accuracy_budget")
    request = request_from_spec(spec_from_proto(message), out_dir=Path("/o"))
    assert request.no_accuracy_budget and request.accuracy_budget is None
    budget = spec_from_proto(spec_to_proto({**spec, "no_accuracy_budget": None, "accuracy_budget": 0.02}))
    assert (budget["accuracy_budget"], budget["no_accuracy_budget"]) == (0.02, False)
    both = CompressRequest(model="/m", calibration=Path("/c"), out_dir=Path("/o"), uniform_ratio=0.5,
                           accuracy_budget=0.02, no_accuracy_budget=True)
    assert [f for f, _ in both.violations()] == ["accuracy_budget"]


def test_local_only_fields_never_go_on_the_wire():
    for name in LOCAL_ONLY:
        with pytest.raises(ValueError, match="does not travel"):
            spec_to_proto({name: "x"})


def test_a_value_too_large_for_its_wire_field_is_named_and_a_local_seed_fits_the_wire():
    """A seed the local CLI takes is one the server takes (the API's seed is an int32); a value that does not fit
    its field says which flag and field, not protobuf's bare "Value out of range"."""
    with pytest.raises(ValueError, match=r"--seed 3000000000 does not fit the request's options\.seed field"):
        spec_to_proto({"seed": 3_000_000_000})
    base = {"model": "/m", "calibration": Path("/c"), "out_dir": Path("/o"), "uniform_ratio": 0.5}
    assert [f for f, _ in CompressRequest(**base, seed=2**31).violations()] == ["seed"]
    assert not CompressRequest(**base, seed=2**31 - 1).violations()
    # the draws' generators take no negative seed (numpy's raised inside the job: INTERNAL on a server)
    assert [f for f, _ in CompressRequest(**base, seed=-1).violations()] == ["seed"]
    assert spec_to_proto({"seed": 2**31 - 1}).options.seed == 2**31 - 1


def test_api_field_paths_follow_the_proto():
    assert api_field("samples") == "options.samples" and api_field("uniform_ratio") == "uniform_ratio"


def test_every_violation_is_listed_and_is_an_input_error():
    bad = CompressRequest(model="", calibration=Path("c"), out_dir=Path("o"), uniform_ratio=1.5, target_speedup=2,
                          samples=0, method="magic", precision="fp8", shape={"batch": 0})
    fields = {f for f, _ in bad.violations()}
    assert {"model", "uniform_ratio", "target_speedup", "samples", "method", "precision", "shape"} <= fields
    with pytest.raises(InputError, match="--samples must be in"):
        bad.validate()


def test_a_device_that_is_none_and_a_target_with_nothing_to_remove_are_refused():
    """--device foo / meta were tracebacks from inside the solves; --min-width 1 with --remove-blocks 0 ran a whole
    round of target mode that could narrow nothing."""
    base = {"model": "m", "calibration": Path("c"), "out_dir": Path("o")}
    for device in ("foo", "meta", "cuda:x", "gpu"):
        assert "device" in dict(CompressRequest(**base, uniform_ratio=0.5, device=device).violations()), device
    for device in ("cpu", "cuda", "cuda:1"):
        assert not CompressRequest(**base, uniform_ratio=0.5, device=device).violations(), device
    refused = dict(CompressRequest(**base, target_speedup=1.5, min_width=1.0, remove_blocks=0).violations())
    assert "nothing to remove" in refused["min_width"]
    assert not CompressRequest(**base, target_speedup=1.5, min_width=1.0).violations()  # blocks may still go


def test_request_from_spec_refuses_unknown_fields():
    with pytest.raises(TypeError, match="no field 'nonsense'"):
        request_from_spec({"nonsense": 1})


def test_reconstruction_steps_default_by_model_kind_and_never_for_magnitude_pruning():
    base = {"model": "m", "calibration": Path("c"), "out_dir": Path("o"), "uniform_ratio": 0.5}
    assert CompressRequest(**base).refine_steps_or(300) == 300  # unset: the kind's default
    assert CompressRequest(**base, refine_steps=0).refine_steps_or(300) == 0
    assert CompressRequest(**base, refine_steps=20).refine_steps_or(300) == 20
    assert CompressRequest(**base, method="mp").refine_steps_or(300) == 0  # mp uses no calibration data
    assert not CompressRequest(**base, method="mp").violations()
    refused = dict(CompressRequest(**base, method="mp", refine_steps=10).violations())
    assert "does not apply to --method mp" in refused["refine_steps"]
    assert "--refine-steps must be in" in dict(CompressRequest(**base, refine_steps=-1).violations())["refine_steps"]
    assert not CompressRequest(**base, latency_probes=0).violations()
    probes = dict(CompressRequest(**base, latency_probes=21).violations())
    assert "--latency-probes must be in" in probes["latency_probes"]


def test_text_calibration_defaults_by_attention_kind_and_explicit_values_win():
    base = {"model": "m", "calibration": Path("c"), "out_dir": Path("o"), "uniform_ratio": 0.5}
    request = CompressRequest(**base)
    encoder, decoder = request.text_calibration(causal=False), request.text_calibration(causal=True)
    assert (encoder.sequences, encoder.min_length, encoder.length) == (2048, 16, 128)  # many contexts
    assert (decoder.sequences, decoder.min_length, decoder.length) == (128, 128, 128)  # full causal windows
    short = CompressRequest(**base, sequence_length=8).text_calibration(causal=False)
    assert (short.min_length, short.length) == (8, 8)  # never longer than the longest window
    given = CompressRequest(**base, sequences=64, min_sequence_length=32, sequence_length=64)
    assert given.text_calibration(causal=False) == given.text_calibration(causal=True)
    assert (given.text_calibration(causal=True).sequences, given.text_calibration(causal=True).min_length) == (64, 32)
    refused = dict(CompressRequest(**base, min_sequence_length=200).violations())
    assert "--min-sequence-length must be in [2, --sequence-length 128] (got 200)" in refused["min_sequence_length"]
    assert "--sequences must be in" in dict(CompressRequest(**base, sequences=0).violations())["sequences"]


def test_min_sequence_length_travels_on_the_wire_and_unset_stays_the_kind_default():
    spec = spec_from_proto(spec_to_proto({"min_sequence_length": 24, "sequences": 300}))
    assert spec["min_sequence_length"] == 24 and spec["sequences"] == 300
    assert "min_sequence_length" not in spec_from_proto(spec_to_proto({})) and "sequences" not in spec_from_proto(
        spec_to_proto({}))


def test_add_bias_is_refused_for_methods_without_an_intercept_and_travels_on_the_wire():
    base = {"model": "m", "calibration": Path("c"), "out_dir": Path("o"), "uniform_ratio": 0.5}
    assert CompressRequest(**base).add_bias == "auto"
    assert not CompressRequest(**base, method="flap", add_bias="no").violations()
    assert not CompressRequest(**base, method="osscar", add_bias="yes").violations()
    for method in ("mp", "wanda-sp"):
        refused = dict(CompressRequest(**base, method=method, add_bias="yes").violations())
        assert f"--add-bias yes needs a method that compensates (--method {method}" in refused["add_bias"]
    assert "--add-bias must be one of auto, yes, no" in dict(CompressRequest(**base, add_bias="maybe").violations())[
        "add_bias"]
    assert spec_from_proto(spec_to_proto({"add_bias": "no"}))["add_bias"] == "no"
    assert "add_bias" not in spec_from_proto(spec_to_proto({}))  # unset: the request's default (auto)


def test_a_perplexity_budget_may_allow_more_than_twice_dense():
    """A relative rise of a perplexity may exceed 1 (1.0: the default 2x rule stated explicitly); zero, negative
    and non-finite budgets are refused."""
    base = dict(model="/m", calibration=Path("/c"), out_dir=Path("/o"), uniform_ratio=0.5)
    for budget in (1.0, 1.5):
        assert "accuracy_budget" not in dict(CompressRequest(**base, accuracy_budget=budget).violations())
    for budget in (0.0, -0.5, float("inf"), float("nan")):
        assert "accuracy_budget" in dict(CompressRequest(**base, accuracy_budget=budget).violations())


def test_options_a_job_has_no_use_for_are_named_with_what_they_are_for():
    from service.job.request import IMAGES, TEXT, TRANSFORMER

    base = dict(model="m", calibration=Path("c"), out_dir=Path("o"))
    defaults = CompressRequest(**base, uniform_ratio=0.5)
    assert defaults.ignored_options({IMAGES}) == defaults.ignored_options({TEXT, TRANSFORMER}) == []
    cnn_flags = CompressRequest(**base, uniform_ratio=0.5, stream=True, sequences=64, gqa="kv-groups",
                                back_off=True, samples=100, shape={"batch": 4})
    assert cnn_flags.ignored_options({IMAGES}) == [
        "--sequences (for text models)", "--stream (for transformers)",
        "--back-off (in target mode only)", "--gqa (for transformers)"]
    # the same flags on a decoder: only the images' one and the target mode's
    assert cnn_flags.ignored_options({TEXT, TRANSFORMER}) == [
        "--samples (for image models)", "--back-off (in target mode only)"]
    # in target mode on a vision transformer nothing of these is ignored but the text draw
    target = CompressRequest(**base, target_speedup=1.5, samples=100, back_off=True, max_rounds=2, sequences=64)
    assert target.ignored_options({IMAGES, TRANSFORMER}) == ["--sequences (for text models)"]
