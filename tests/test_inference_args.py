"""Command lines: the server flags the three services share, and every engine flag from
`llmserve serve` through the launcher's child argv to EngineConfig. Parsing only: no server
starts and no weights load (config_from_args reads the tiny model's config.json for its name)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from llmserve.tools.cli import build_parser as build_cli_parser
from llmserve.tools.cli import main as cli_main
from llmserve.gateway.__main__ import build_parser as build_gateway_parser
from llmserve.gateway.__main__ import config_from_args as gateway_config_from_args
from llmserve.gateway.__main__ import main as gateway_main
from llmserve.inference.__main__ import config_from_args, parse_args
from llmserve.inference.engine.config import EngineConfig
from llmserve.inference.models.attention_backend import resolve_attention_backend
from llmserve.inference.engine_flags import flag_of, flagged_fields, parsed_default, value_type
from llmserve.buckets import BucketConfig
from llmserve.tools.launcher import PREPROCESS_ENGINE_OPTIONS, common_argv, inference_argv, preprocess_argv
from llmserve.preprocess.__main__ import build_parser as build_preprocess_parser
from llmserve.preprocess.__main__ import config_from_args as preprocess_config_from_args
from llmserve.tools.serve_config import ServeConfig, serve_config_from_args

NEW_FLAGS = ("--attention-backend", "--kv-cache-dtype", "--quantization", "--no-async-scheduling")
SERVER_FLAGS = ("--host", "--port", "--port-file", "--log-level", "--grace-period-s")


def inference_args(model_dir: Path, *flags: str):
    return parse_args(["--model", str(model_dir), *flags])


def gateway_args(*flags: str):
    return build_gateway_parser().parse_args(
        ["--preprocess", "127.0.0.1:1", "--inference", "127.0.0.1:2", "--model", "m", *flags]
    )


def preprocess_args(*flags: str):
    return build_preprocess_parser().parse_args(["--model", "m", *flags])


# --- the shared server flags ---------------------------------------------------------------------


def test_server_flags_have_each_services_defaults(tiny_model_dir):
    defaults = {
        "preprocess": preprocess_args(),
        "inference": inference_args(tiny_model_dir),
        "gateway": gateway_args(),
    }
    ports = {name: args.port for name, args in defaults.items()}
    assert ports == {"preprocess": 50052, "inference": 0, "gateway": 50051}
    for args in defaults.values():
        assert (args.host, args.port_file, args.log_level, args.grace_period_s) == ("127.0.0.1", None, "INFO", 10.0)


def test_server_flags_parse_the_same_in_every_service(tiny_model_dir, tmp_path):
    flags = [
        "--host", "0.0.0.0", "--port", "7000", "--port-file", str(tmp_path / "port"),
        "--log-level", "debug", "--grace-period-s", "2.5",
    ]  # fmt: skip
    for args in (preprocess_args(*flags), inference_args(tiny_model_dir, *flags), gateway_args(*flags)):
        assert (args.host, args.port, args.port_file, args.log_level, args.grace_period_s) == (
            "0.0.0.0", 7000, str(tmp_path / "port"), "DEBUG", 2.5,
        )  # fmt: skip


@pytest.mark.parametrize("build", [build_preprocess_parser, build_gateway_parser])
def test_help_explains_the_server_flags(build):
    text = build().format_help()
    for flag in SERVER_FLAGS:
        assert flag in text
    assert "server:" in text  # one group, the same in every service


def test_inference_rejects_an_unknown_log_level(tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as info:
        inference_args(tiny_model_dir, "--log-level", "LOUD")
    assert info.value.code == 2
    assert "argument --log-level: invalid choice: 'LOUD'" in capsys.readouterr().err


# --- inference kernel and precision flags --------------------------------------------------------


def test_new_inference_flags_default_to_the_engine_defaults(tiny_model_dir):
    engine = config_from_args(inference_args(tiny_model_dir)).engine
    assert (engine.attention_backend, engine.kv_cache_dtype, engine.quantization) == ("auto", "auto", "none")
    assert engine.piecewise_graphs  # on where they apply (triton on CUDA): docs/benchmarks.md, "Twelfth session"


@pytest.mark.parametrize(("device", "overlaps"), [("cpu", False), ("cuda", True), ("cuda:1", True)])
def test_async_scheduling_is_on_by_default_only_where_a_device_computes_beside_the_host(tiny_model_dir, device, overlaps):
    engine = config_from_args(inference_args(tiny_model_dir, "--device", device)).engine
    assert engine.async_scheduling is overlaps
    engine = config_from_args(inference_args(tiny_model_dir, "--device", device, "--no-async-scheduling")).engine
    assert engine.async_scheduling is False


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--attention-backend", "triton"], {"attention_backend": "triton"}),
        (["--attention-backend", "portable"], {"attention_backend": "portable"}),
        (["--kv-cache-dtype", "fp8"], {"kv_cache_dtype": "fp8"}),
        (["--quantization", "fp8"], {"quantization": "fp8"}),
        (["--quantization", "int8"], {"quantization": "int8"}),
        (["--no-async-scheduling"], {"async_scheduling": False}),
        (["--no-piecewise-graphs"], {"piecewise_graphs": False}),
        (
            ["--attention-backend", "triton", "--kv-cache-dtype", "fp8", "--quantization", "int8",
             "--no-async-scheduling"],
            {"attention_backend": "triton", "kv_cache_dtype": "fp8", "quantization": "int8", "async_scheduling": False},
        ),
    ],
)
def test_new_inference_flags_reach_engine_config(tiny_model_dir, flags, expected):
    engine = config_from_args(inference_args(tiny_model_dir, *flags)).engine
    defaults = config_from_args(inference_args(tiny_model_dir)).engine
    assert engine == dataclasses.replace(defaults, **expected)


@pytest.mark.parametrize(
    ("flag", "value", "choices"),
    [
        ("--attention-backend", "cuda", "'auto', 'portable', 'triton'"),
        ("--kv-cache-dtype", "fp16", "'auto', 'fp8'"),
        ("--quantization", "int4", "'none', 'fp8', 'int8'"),
    ],
)
def test_invalid_values_fail_at_argparse(tiny_model_dir, capsys, flag, value, choices):
    for parse in (lambda: inference_args(tiny_model_dir, flag, value), lambda: cli_main(["serve", flag, value])):
        with pytest.raises(SystemExit) as info:
            parse()
        assert info.value.code == 2
        assert f"argument {flag}: invalid choice: '{value}' (choose from {choices})" in capsys.readouterr().err


def test_inference_help_explains_the_new_flags(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in NEW_FLAGS:
        assert flag in text
    assert "auto = triton on CUDA when triton imports, portable otherwise (always portable on CPU)" in text
    assert "(needs the triton attention backend, so CUDA)" in text
    assert "(CUDA, compute capability >= 8.9)" in text


def test_auto_attention_is_portable_on_cpu_whether_or_not_triton_imports():
    assert resolve_attention_backend("auto", torch.device("cpu")) == "portable"
    assert resolve_attention_backend("portable", torch.device("cpu")) == "portable"


# --- `llmserve serve` → launcher → inference ---------------------------------------------------


def test_serve_help_lists_the_new_flags(capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["serve", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for flag in NEW_FLAGS:
        assert flag in text


def serve_config(*flags: str) -> ServeConfig:
    return serve_config_from_args(build_cli_parser().parse_args(["serve", *flags]))


def inference_command(config: ServeConfig, model_dir: Path) -> list[str]:
    return inference_argv(config, common_argv(config, model_dir, None), 0)


def test_serve_passes_nothing_extra_by_default(tiny_model_dir):
    config = serve_config()
    assert config == ServeConfig(model="default")
    common = common_argv(config, tiny_model_dir, None)
    assert inference_argv(config, common, 0) == ["--host", "127.0.0.1", "--port", "0", *common]
    assert preprocess_argv(config, common) == ["--host", "127.0.0.1", "--port", "0", *common]


def test_serve_replicas_get_ids_and_one_gpu_each_on_cuda(tiny_model_dir):
    def replica_flags(config, replica):
        command = inference_argv(config, common_argv(config, tiny_model_dir, None), replica)
        engine = config_from_args(parse_args(command)).engine
        return engine.device, command[command.index("--replica-id") + 1]

    cuda = serve_config("--replicas", "3", "--device", "cuda")
    assert [replica_flags(cuda, i) for i in range(3)] == [("cuda:0", "replica-0"), ("cuda:1", "replica-1"), ("cuda:2", "replica-2")]
    split = serve_config("--replicas", "2", "--device", "cuda", "--tensor-parallel-size", "2")
    assert [replica_flags(split, i)[0] for i in range(2)] == ["cuda:0", "cuda:2"]  # ranks on 0-1 and 2-3
    shared = serve_config("--replicas", "2", "--device", "cuda:1")
    assert [replica_flags(shared, i) for i in range(2)] == [("cuda:1", "replica-0"), ("cuda:1", "replica-1")]
    with pytest.raises(ValueError, match="--replicas must be >= 1"):
        serve_config("--replicas", "0")


def test_serve_refuses_flags_that_do_not_fit_in_one_line(capsys):
    assert cli_main(["serve", "--replicas", "0"]) == 2
    assert capsys.readouterr().err == "llmserve serve: error: --replicas must be >= 1, got 0\n"
    assert cli_main(["serve", "--metrics-port", "70000"]) == 2
    assert "--metrics-port must leave room for every service's port" in capsys.readouterr().err


def test_serve_metrics_port_gives_each_service_its_own(tiny_model_dir):
    config = serve_config("--replicas", "2", "--metrics-port", "9400")
    common = common_argv(config, tiny_model_dir, None)

    def metrics_port(command):
        return config_from_args(parse_args(command)).observability.metrics_port if command is not None else None

    assert [metrics_port(inference_argv(config, common, i)) for i in range(2)] == [9402, 9403]
    preprocess = preprocess_argv(config, common)
    assert preprocess[preprocess.index("--metrics-port") + 1] == "9401"
    assert "--metrics-port" not in inference_argv(serve_config(), common, 0)


def test_serve_log_flags_reach_every_service(tiny_model_dir):
    config = serve_config("--log-format", "json", "--log-prompts")
    observability = config_from_args(parse_args(inference_argv(config, common_argv(config, tiny_model_dir, None), 0))).observability
    assert (observability.log_format, observability.log_prompts) == ("json", True)


def test_serve_flags_reach_the_inference_engine_config(tiny_model_dir):
    serve_flags = [
        "--attention-backend", "triton", "--kv-cache-dtype", "fp8", "--quantization", "int8",
        "--no-async-scheduling",
    ]  # fmt: skip
    command = inference_command(serve_config(*serve_flags), tiny_model_dir)
    assert command[-7:] == [
        "--no-async-scheduling", "--attention-backend", "triton", "--kv-cache-dtype", "fp8", "--quantization", "int8",
    ]  # fmt: skip

    engine = config_from_args(parse_args(command)).engine
    assert (engine.attention_backend, engine.kv_cache_dtype, engine.quantization, engine.async_scheduling) == (
        "triton", "fp8", "int8", False,
    )  # fmt: skip
    assert engine.model_path == tiny_model_dir.resolve()


def non_default_value(field):
    """A value of the field's flag that is not its default, as the flag parses it."""
    if value_type(field) is bool:
        return not field.default
    flag, default = flag_of(field), parsed_default(field)
    if flag.choices:
        return next(choice for choice in reversed(flag.choices) if choice != default)
    if value_type(field) is str:  # the two free-form string flags
        return "64,256" if field.name == "length_buckets" else "cuda:1"
    return (default or 1) * 2 + 1 if value_type(field) is int else default / 2


def flag_argv(field, value) -> list[str]:
    return [flag_of(field).name] if value_type(field) is bool else [flag_of(field).name, str(value)]


ENGINE_FIELDS = flagged_fields()


@pytest.mark.parametrize("field", ENGINE_FIELDS, ids=[flag_of(f).name for f in ENGINE_FIELDS])
def test_every_engine_flag_round_trips_from_serve_to_engine_config(tiny_model_dir, field):
    """One declaration, three command lines: `llmserve serve`'s parser takes the flag, the
    launcher passes exactly it on, and the inference service's parser turns it into the field."""
    value = non_default_value(field)
    flag = flag_argv(field, value)
    config = serve_config(*flag)
    assert config.engine == {**ServeConfig().engine, field.name: value}

    command = inference_command(config, tiny_model_dir)
    assert command == [*inference_command(ServeConfig(), tiny_model_dir), *flag]
    engine = config_from_args(parse_args(command)).engine
    baseline = config_from_args(inference_args(tiny_model_dir)).engine
    assert getattr(engine, field.name) == value
    for other in ENGINE_FIELDS:
        follows_device = other.name == "dtype" or (other.name == "async_scheduling" and field.name == "device")
        if other.name != field.name and not follows_device:  # unset, those follow the device
            assert getattr(engine, other.name) == getattr(baseline, other.name), other.name


def test_engine_config_fields_without_a_flag_are_the_ones_set_elsewhere():
    unflagged = {f.name for f in dataclasses.fields(EngineConfig)} - {f.name for f in ENGINE_FIELDS}
    # model_path and model_name come from --model / --model-name; the other two have no flag yet.
    assert unflagged == {"model_path", "model_name", "kv_cpu_memory_bytes", "enable_chunked_prefill"}


def test_serve_passes_block_size_context_and_buckets_to_preprocess_too(tiny_model_dir):
    config = serve_config("--block-size", "32", "--max-context-tokens", "512", "--length-buckets", "64,256")
    assert set(PREPROCESS_ENGINE_OPTIONS) == {"block_size_tokens", "max_context_tokens", "length_buckets"}
    command = preprocess_argv(config, common_argv(config, tiny_model_dir, None))
    preprocess = preprocess_config_from_args(build_preprocess_parser().parse_args(command))
    engine = config_from_args(parse_args(inference_command(config, tiny_model_dir))).engine
    assert (preprocess.block_size_tokens, preprocess.max_context_tokens) == (32, 512)
    assert (engine.block_size_tokens, engine.max_context_tokens) == (32, 512)
    assert preprocess.length_buckets == BucketConfig.parse(engine.length_buckets) == BucketConfig((64, 256))


def test_unset_dtype_follows_the_device(tiny_model_dir):
    assert config_from_args(inference_args(tiny_model_dir)).engine.dtype == "float32"
    assert config_from_args(inference_args(tiny_model_dir, "--device", "cuda")).engine.dtype == "bfloat16"
    assert config_from_args(inference_args(tiny_model_dir, "--device", "cuda", "--dtype", "float16")).engine.dtype == (
        "float16"
    )


def test_a_flag_combination_the_engine_cannot_run_fails_with_one_clear_line(tiny_model_dir, tmp_path):
    """fp8 KV needs the Triton attention kernels, which a CPU engine does not use: the service
    exits 1 saying so (no traceback) and never writes its port file."""
    import subprocess
    import sys

    port_file = tmp_path / "port"
    completed = subprocess.run(
        [sys.executable, "-m", "llmserve.inference", "--model", str(tiny_model_dir), "--kv-cache-dtype", "fp8",
         "--port-file", str(port_file)],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 1
    assert "cannot start the engine: kv_cache_dtype 'fp8' needs the triton attention backend" in completed.stderr
    assert "Traceback" not in completed.stderr
    assert not port_file.exists()


def test_gateway_routing_weights_reach_the_config_and_a_negative_one_is_a_usage_error(capsys):
    routing = gateway_config_from_args(gateway_args("--routing-load-weight", "2.5", "--routing-queue-weight", "1")).routing
    assert (routing.load_weight, routing.queue_weight) == (2.5, 1.0)
    assert gateway_config_from_args(gateway_args()).routing.load_weight == 1.0  # the default
    for flag in ("--routing-load-weight", "--routing-queue-weight"):
        with pytest.raises(SystemExit) as info:
            gateway_main(["--preprocess", "127.0.0.1:1", "--inference", "127.0.0.1:2", "--model", "m", flag, "-1"])
        assert info.value.code == 2
        assert "must be >= 0, got -1.0" in capsys.readouterr().err
