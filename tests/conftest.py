"""Shared test set-up: golden-file checks, and torch's process-wide settings kept as the session
found them. The ``slow`` marker is declared in pyproject.toml (CI runs slow tests too; ``-m "not
slow"`` skips them locally); the shared tiny models live in tests/cases.py.

Process-wide settings (the CPU thread count, which graphmem's CPU scratch rules read,
graphmem/oprules/registry.py; the default dtype; deterministic algorithms; grad mode) outlive the
test that changes them, and under ``-n 2`` which tests share a worker varies, so a leaked change
makes results depend on test order. Change them only inside ``torch_settings(...)`` (or the
``one_thread`` fixture); ``_settings_kept`` fails a test or fixture that leaves them changed.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

# The real CPU steps run oneDNN's AVX2 kernels on every x86-64 CPU with AVX2 (docs/validation.md, "The
# suite on any x86 CPU"): oneDNN reads ONEDNN_MAX_CPU_ISA once, at its first use, and ATen its
# ATEN_CPU_CAPABILITY at its first dispatch, so both are set here, before torch is imported (pytest-xdist
# workers and the gloo ranks the tests spawn inherit them). oneDNN's cap also turns off PyTorch's bf16
# routes into oneDNN (mkldnn_bf16_device_check is oneDNN's effective ISA on x86-64): bf16 GEMMs then
# run ATen's own kernel, as on an AVX2 CPU, so no test depends on oneDNN's bf16 GEMM scratch, which
# graphmem has no rule for. graphmem's CPU target reads the same cap (graphmem/oprules/isa.py).
# GRAPHMEM_TEST_NATIVE_ISA=1 runs the CPU's own kernels instead (the lists below say what holds where).
NATIVE_ISA = os.environ.get("GRAPHMEM_TEST_NATIVE_ISA") == "1"


def _cpu_has_avx2() -> bool:
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return False


PINNED_ISA = not NATIVE_ISA and _cpu_has_avx2()
if PINNED_ISA:
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")

# Each pytest-xdist worker gets its share of the CPU's cores for torch's intra-op threads (2 workers on
# 2 cores: one thread each), not every core: two workers each running one OpenMP thread per core spin
# against each other (measured on 2 AVX2 cores, 123 tests of test_checkpoint_plans/test_budget/test_api:
# 283 s with two threads per worker, 251 s with one). graphmem's CPU scratch rules read the thread count
# the step runs with (graphmem/oprules/registry.py), so the predictions follow; tests that need another
# count set it in torch_settings(...). OMP_NUM_THREADS set by the user wins.
_WORKERS = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
if _WORKERS and _WORKERS.isdigit() and int(_WORKERS) > 0:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(_WORKERS))))

import torch  # noqa: E402  (after the ISA and thread settings above)

import graphmem.oprules.isa as isa  # noqa: E402

UPDATE_GOLDEN = os.environ.get("GRAPHMEM_UPDATE_GOLDEN") == "1"


def check_golden(text: str, path: Path) -> None:
    """``text`` must equal the golden file; ``GRAPHMEM_UPDATE_GOLDEN=1`` rewrites it (check the diff)."""
    if UPDATE_GOLDEN:
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"{path} is missing; create it with GRAPHMEM_UPDATE_GOLDEN=1"
    assert text == path.read_text(encoding="utf-8"), f"output differs from {path}; GRAPHMEM_UPDATE_GOLDEN=1 if intended"


def _settings() -> dict[str, Any]:
    return {"num_threads": torch.get_num_threads(), "default_dtype": torch.get_default_dtype(),
            "deterministic": (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()),
            "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark),
            "grad_enabled": torch.is_grad_enabled()}


def _restore(s: dict[str, Any]) -> None:
    torch.set_num_threads(s["num_threads"])
    torch.set_default_dtype(s["default_dtype"])
    torch.use_deterministic_algorithms(s["deterministic"][0], warn_only=s["deterministic"][1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = s["cudnn"]
    torch.set_grad_enabled(s["grad_enabled"])


SESSION_SETTINGS = _settings()  # as this process (xdist worker) started


@contextlib.contextmanager
def torch_settings(num_threads: Optional[int] = None, default_dtype: Optional[torch.dtype] = None,
                   deterministic: Optional[bool] = None) -> Iterator[None]:
    """Change torch's process-wide settings for a block; every one of them is restored on exit."""
    before = _settings()
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if default_dtype is not None:
            torch.set_default_dtype(default_dtype)
        if deterministic is not None:
            torch.use_deterministic_algorithms(deterministic)
        yield
    finally:
        _restore(before)


@pytest.fixture
def threads() -> Iterator[None]:
    """The test sets the thread count itself (the scratch rules' per-thread buffers); restored after."""
    with torch_settings():
        yield


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The test runs with one CPU thread, as each real gloo rank does (tests/dist_truth.py)."""
    with torch_settings(num_threads=1):
        yield


def _changed(now: dict[str, Any]) -> str:
    return ", ".join(f"{k} {SESSION_SETTINGS[k]} -> {v}" for k, v in now.items() if v != SESSION_SETTINGS[k])


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    """Each test starts with dynamo's caches empty, as a fresh process does: a model class's forward is
    one code object, and every model instance another test compiled adds a cache entry to it, until
    dynamo's ``recompile_limit`` (8) makes it run the frame eagerly, silently (in one long pytest-xdist
    worker a compiled FSDP Trainer rank then captured its eager step, and a real Inductor step ran eager)."""
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _settings_kept(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the test whose fixtures (set up before this one: wider scopes first) or body leave
    torch's settings changed, restores them, so the tests after it run as the session started."""
    now = _settings()
    if now != SESSION_SETTINGS:
        _restore(SESSION_SETTINGS)
        pytest.fail(f"a fixture of {request.node.nodeid} left torch's settings changed ({_changed(now)}); "
                    "change them inside tests/conftest.py's torch_settings(...) or the one_thread fixture")
    yield
    now = _settings()
    if now != SESSION_SETTINGS:
        _restore(SESSION_SETTINGS)
        pytest.fail(f"{request.node.nodeid} left torch's settings changed ({_changed(now)}); change them "
                    "inside tests/conftest.py's torch_settings(...) or the one_thread fixture")


# Tests that compare graphmem's oneDNN rules (graphmem/oprules/: convolution, LSTM, CPU flash-attention
# and bf16 GEMM scratch) with the real kernels this process runs (graphmem/oprules/isa.py: AVX2 unless
# GRAPHMEM_TEST_NATIVE_ISA=1 on an AVX-512 CPU). The rules were derived from oneDNN's AVX-512 kernels
# and made ISA-aware for AVX2 ones (graphmem/oprules/conv_gemm.py ``simd_w``): their per-op comparisons
# run on both. What holds on AVX-512 only is skipped where oneDNN runs AVX2 kernels, measured on a
# two-core AVX2 machine (graphmem below the real peak): compiled ConvNeXt, 1,216 B under (6,944 B before
# the AVX2 1x1 and strided rules), whose real peak is in a channels-last 2x2 stride-2 downsampling
# backward of 80 input channels (brgconv_strided:avx2 in nhwc: a weight padded to the ic_block its
# blocking search picks, outside graphmem/oprules/conv_brgemm.py's domain); and GPT-2's CPU autocast
# plans, whose real peak is 24 B above the plan's (on AVX-512 inside the test's allowance for oneDNN's
# bf16 GEMM scratch, which AVX2 kernels do not run).
AVX512_KERNELS = (
    "tests/compiled/test_compiled_rules.py::test_compiled_peak_equals_real_compiled_step[timm_convnext_atto]",
    "tests/planning/test_checkpoint_plans.py::test_autocast_plans_match_real_cpu_autocast_runs[gpt2-cpu]",
)

# Real bf16 steps compared to the byte: they hold where bf16 GEMMs run ATen's own kernel (AVX2, or any
# CPU under the pin above). Where PyTorch sends them to oneDNN (GRAPHMEM_TEST_NATIVE_ISA=1 on an
# AVX-512-BF16 or AMX CPU: ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``) the real peaks are above
# the prediction by oneDNN's bf16 GEMM scratch, which graphmem has no rule for (docs/kernel-rules.md):
# measured on an AVX-512-BF16 AMD EPYC, 7,808 B on both peaks of the first test, -2.92 % and -4.94 % on
# rank 0 of the gloo jobs.
ONEDNN_BF16_GEMM = (
    "tests/trainers/test_hf_trainer.py::test_bf16_autocast_through_accelerate_matches_a_real_step",
    "tests/trainers/test_hf_trainer_fsdp.py::test_gpt2_fsdp_ranks_in_bf16_against_a_real_gloo_job",
    "tests/trainers/test_hf_trainer_fsdp.py::test_tiny_llama_fsdp_ranks_compiled_against_a_real_gloo_job[aot_eager-True]",
)

# The per-op comparisons: oneDNN's x86-64 kernels (AVX-512 or AVX2); on other CPUs the rules decline
# (graphmem/oprules/conv_gemm.py ``onednn_x64``), so these are skipped there.
X64_KERNELS = (
    "tests/oprules/test_workspace.py::test_onednn_lstm_workspace_equals_real_kernel",
    "tests/oprules/test_workspace.py::test_flash_attention_cpu_scratch",
    "tests/oprules/test_workspace_conv.py::test_depthwise",
    "tests/oprules/test_workspace_conv_dw.py::test_plain_depthwise",
    "tests/oprules/test_workspace_conv_gemm.py::test_gemm_convolution_backward_equals_real_kernel",
    "tests/oprules/test_workspace_conv_gemm.py::test_conv_models_peak_within_one_percent_of_real_step",
    "tests/oprules/test_workspace_conv_jit.py::test_",
    "tests/compiled/test_compiled_rules.py::test_compiled_peak_equals_real_compiled_step[timm_convnext_atto]",
    "tests/capture/test_zoo_accuracy.py::test_zoo_saved_exact_and_peak_within_named_tolerance[timm_convnext_atto]",
    "tests/planning/test_zoo_plans.py::test_a_plan_holds_on_a_real_step[convnext]",
    "tests/planning/test_checkpoint_plans.py::test_autocast_plans_match_real_cpu_autocast_runs",
    "tests/capture/test_zoo_accuracy.py::test_zoo_saved_exact_and_peak_within_named_tolerance[timm_resnet18]",
    "tests/capture/test_zoo_accuracy.py::test_zoo_saved_exact_and_peak_within_named_tolerance[torchvision_resnet18]",
    "tests/trainers/test_hf_trainer.py::test_gpt2_bf16_with_gradient_checkpointing_later_steps",
)


# The quick command's slowest tests, timed with `--durations` on a two-core AVX2 machine (the quick
# suite then took 15 min 39 s, 899 tests; the README's target is about 10 minutes): marked slow here,
# so the full command (CI) still runs them. Each is a real-step or re-capture comparison that also runs
# on smaller shapes or other models in the quick set.
SLOW_ON_TWO_CORES = (
    "tests/compiled/test_compiled_budget.py::test_sweep_matches_real_compiled_steps[hf_llama]",  # 65 s
    "tests/compiled/test_compiled_budget.py::test_sweep_matches_real_compiled_steps[hf_gpt2]",  # 51 s
    "tests/advise/test_advise.py::test_the_chosen_combination_fits_when_no_single_lever_does",  # 43 s
    "tests/formula/test_coefficients.py::test_analyze_formula_flag_adds_the_formula_to_text_json_and_markdown",  # 38 s
    "tests/planning/test_selective.py::test_selective_plans_over_micro_batches_equal_recaptured_peaks",  # 32 s
    "tests/advise/test_advise.py::test_hf_causal_lm_loss_lever_is_analyze_and_a_real_step",  # 32 s
    "tests/validation/test_validate.py::test_cli_validate_takes_the_loop_options",  # 28 s
    "tests/compiled/test_compiled_budget.py::test_sweep_matches_real_compiled_steps[gpt2_explicit]",  # 27 s
    "tests/validation/test_gpu_truth.py::test_dry_subset",  # 27 s
    "tests/planning/test_selective.py::test_selective_plans_under_autocast_equal_recaptured_peaks",  # 25 s
    "tests/planning/test_checkpoint_plans.py::test_cli_plan_text_and_json",  # 25 s
    "tests/formula/test_coefficients.py::test_polynomial_reproduces_captured_bytes_at_five_held_out_points[llama]",  # 24 s
    "tests/formula/test_coefficients.py::test_polynomial_reproduces_captured_bytes_at_five_held_out_points[resnet]",  # 24 s
    "tests/planning/test_checkpoint_plans.py::test_autocast_plans_equal_recaptured_peaks[llama-cpu]",  # 23 s
    "tests/formula/test_coefficients.py::test_formula_cli_text_and_json",  # 22 s
    "tests/planning/test_checkpoint_plans.py::test_plans_over_unlike_blocks_in_several_stages",  # 21 s
    "tests/planning/test_checkpoint_plans.py::test_plan_peaks_equal_recaptured_peaks[llama]",  # 21 s
    "tests/planning/test_checkpoint_plans.py::test_plans_with_tensors_only_checkpoints_keep[2]",  # 20 s
    "tests/planning/test_checkpoint_plans.py::test_plans_over_micro_batches_equal_recaptured_peaks_and_real_steps[2-adam]",  # 20 s
    "tests/advise/test_advise.py::test_the_pipeline_lever_is_every_ranks_stage_with_its_optimizer",  # 20 s
    "tests/planning/test_checkpoint_plans.py::test_plans_over_micro_batches_equal_recaptured_peaks_and_real_steps[3-None]",  # 19 s
    "tests/advise/test_advise.py::test_lora_and_qlora_levers_are_analyze_with_those_options",  # 19 s
    "tests/formula/test_coefficients.py::test_sweep_cli_table_and_json",  # 18 s
    "tests/formula/test_coefficients.py::test_fit_sequence_length_for_a_fixed_batch",  # 17 s
    "tests/formula/test_coefficients.py::test_fit_gpt2_xl_80gib_seq_1024_answer_fits_and_next_does_not",  # 17 s
    "tests/formula/test_korthikanti.py::test_megatron_block_fp16_cuda_alpha_34_beta_5[True]",  # 17 s
    "tests/advise/test_advise.py::test_loss_and_optimizer_levers_match_a_real_cpu_step",  # 17 s
    "tests/advise/test_advise.py::test_attention_lever_on_the_cuda_target",  # 16 s
    "tests/formula/test_coefficients.py::test_llama_grouped_query_attention_alpha_by_hand",  # 16 s
    "tests/formula/test_coefficients.py::test_gpt2_explicit_attention_with_dropout_alpha_beta_by_hand",  # 16 s
    "tests/planning/test_selective.py::test_selective_plan_peaks_equal_recaptured_peaks[llama]",  # 15 s
    "tests/planning/test_selective.py::test_selective_plans_beat_plain_checkpointing[llama]",  # 15 s
    "tests/planning/test_checkpoint_plans.py::test_autocast_plans_equal_recaptured_peaks[gpt2-cuda]",  # 15 s
    "tests/planning/test_checkpoint_plans.py::test_plans_with_tensors_only_checkpoints_keep[1]",  # 14 s
    "tests/formula/test_coefficients.py::test_polynomial_reproduces_captured_bytes_at_five_held_out_points[gpt2]",  # 14 s
    "tests/planning/test_checkpoint_plans.py::test_autocast_plans_equal_recaptured_peaks[gpt2-cpu]",  # 14 s
    "tests/distributed/test_distributed_tp.py::test_cli_loss_parallel_keeps_the_logits_split",  # 14 s
    "tests/planning/test_checkpoint_plans.py::test_plans_with_the_optimizer_step_equal_recaptured_peaks",  # 14 s
    "tests/planning/test_checkpoint_plans.py::test_plan_peaks_equal_recaptured_peaks[gpt2]",  # 13 s
    "tests/compiled/test_compiled_training.py::test_transformers_models_compiled_with_adamw_are_real_steps[gpt2_sdpa]",  # 13 s
    # measured 2026-11-29 (1,002 quick tests in 17 min 2 s on two shared AVX2 cores): the slowest quick tests
    "tests/advise/test_advise.py::test_the_batch_lever_is_the_largest_batch_whose_captured_step_fits[opts1]",  # 42 s
    "tests/advise/test_advise_truth.py::test_the_batch_lever_is_a_real_step[opts1]",  # 32 s
    "tests/compiled/test_compiled_training.py::test_transformers_models_compiled_with_adamw_are_real_steps[llama_gqa]",  # 31 s
    "tests/formula/test_korthikanti.py::test_megatron_block_fp16_cuda_alpha_34_beta_5[False]",  # 26 s
    "tests/planning/test_checkpoint_plans.py::test_plans_that_are_not_made_say_so_in_one_line",  # 25 s
    "tests/advise/test_advise_truth.py::test_the_batch_lever_is_a_real_step[opts0]",  # 25 s
    "tests/advise/test_advise.py::test_the_batch_lever_is_the_largest_batch_whose_captured_step_fits[opts0]",  # 25 s
    "tests/planning/test_checkpoint_plans.py::test_cli_plan_mistakes_are_one_line",  # 21 s
    "tests/compiled/test_compiled.py::test_compiled_saved_bytes_exact[resnet_small]",  # 21 s
    "tests/trainers/test_hf_trainer_compiled.py::test_aot_eager_compiled_trainer_step_without_an_attention_mask_saves_what_a_real_one_saves",  # 20 s
    "tests/trainers/test_hf_trainer_compiled.py::test_aot_eager_compiled_trainer_step_matches_a_real_one",  # 19 s
    "tests/trainers/test_hf_trainer_compiled_ranks.py::test_compiled_training_args_with_world_size_from_the_cli",  # 17 s
    "tests/validation/test_gpu_truth.py::test_gpu_run_plumbing",  # 17 s
    "tests/capture/test_properties.py::test_random_models_match_a_real_cpu_step",  # 17 s
    "tests/formula/test_coefficients.py::test_gpt2_sdpa_without_attention_dropout_has_beta_zero_on_cpu",  # 16 s
    "tests/render/test_report_roundtrip.py::test_kept_answers_round_trip_and_render",  # 15 s
    "tests/compiled/test_compiled.py::test_compiled_saved_bytes_exact[llama_sdpa]",  # 14 s
    "tests/compiled/test_compiled_training.py::test_a_compiled_step_with_its_optimizer_is_a_real_one[gpt2-adamw-foreach-3mb]",  # 14 s
    "tests/planning/test_checkpoint_plans.py::test_identical_blocks_are_measured_at_depth_4_exactly[llama]",  # 14 s
    "tests/compiled/test_compiled_training.py::test_a_compiled_step_with_its_optimizer_is_a_real_one[llama-adam-foreach]",  # 13 s
    "tests/planning/test_checkpoint_plans.py::test_program_equals_brute_force_on_random_chains[0]",  # 13 s
    "tests/compiled/test_compiled.py::test_compiled_peak_matches_a_real_compiled_step[gpt2_explicit]",  # 13 s
    "tests/compiled/test_compiled.py::test_compiled_peak_matches_a_real_compiled_step[llama_sdpa]",  # 13 s
    "tests/capture/test_no_allocation.py::test_gpt2_xl_32x1024_analyzed_in_under_2_gb_rss",  # 12 s
    "tests/passes/test_run_memory.py::test_device_total_rows_for_a_per_rank_nccl_job",  # 12 s
    "tests/planning/test_checkpoint_plans.py::test_apply_refuses_bad_segments",  # 12 s
    "tests/planning/test_zoo_plans.py::test_pieces_that_compose_without_the_kv_cache_give_a_proven_plan",  # 12 s
    "tests/compiled/test_compiled_cuda.py::test_compiled_amp_opens_transformers_maybe_autocast_regions",  # 12 s
    "tests/cli/test_errors.py::test_console_script_exit_code_and_single_stderr_line",  # 12 s
    "tests/compiled/test_compiled_budget.py::test_nonmonotonic_peak_on_gpt2_is_reported",  # 11 s
    "tests/distributed/test_distributed_capture.py::test_each_rank_holds_its_padded_shards[8-llama_gqa]",  # 11 s
    "tests/planning/test_checkpoint_plans.py::test_autocast_plan_cli_prints_a_plan",  # 11 s
    "tests/titan/test_titan_float8.py::test_scaled_mm_on_the_cuda_target[rowwise]",  # 11 s
    "tests/distributed/test_pipeline.py::test_1f1b_holds_min_m_p_minus_r_micro_batches_gpipe_all[4-8-gpt2]",  # 11 s
    "tests/layout/test_hygiene.py::test_leaked_thread_count_fails_the_test_that_leaked_it",  # 11 s
    "tests/planning/test_selective.py::test_selective_plans_beat_plain_checkpointing[gpt2]",  # 11 s
    "tests/planning/test_selective.py::test_selective_plan_peaks_equal_recaptured_peaks[gpt2]",  # 11 s
    "tests/planning/test_checkpoint_plans.py::test_a_plan_fits_every_step_not_only_the_first[adam]",  # 11 s
    "tests/trainers/test_bnb_optim.py::test_8bit_adamw_stepped_in_backward[gpt2_explicit]",  # 10 s
    "tests/distributed/test_distributed_capture.py::test_reshard_after_forward_frees_gathered_blocks_and_the_formula_is_beside_it",  # 10 s
    "tests/distributed/test_distributed_capture.py::test_rank_optimizer_states_are_the_zero3_formulas_row[llama_gqa]",  # 10 s
    "tests/compiled/test_compiled_cuda.py::test_compiled_amp_saved_set_is_the_eager_cuda_autocast[timm_vit-bf16]",  # 10 s
    "tests/planning/test_capacity.py::test_advise_on_cuda_judges_each_setting_on_its_device_total",  # 10 s
    "tests/planning/test_selective.py::test_cli_selective",  # 10 s
    "tests/compiled/test_compiled.py::test_compiled_saved_bytes_exact[gpt2_explicit]",  # 10 s
    "tests/planning/test_checkpoint_plans.py::test_apply_is_real_checkpointing_and_remove_restores",  # 10 s
    "tests/distributed/test_distributed_capture.py::test_rank_lora_holds_half_the_adapters_and_their_states[llama_gqa-q_proj,v_proj]",  # 10 s
    "tests/trainers/test_hf_trainer.py::test_bitsandbytes_8bit_adamw_matches_a_real_step[adamw_bnb_8bit]",  # 9 s
    "tests/planning/test_checkpoint_plans.py::test_autocast_plans_match_real_cpu_autocast_runs[llama-cpu]",  # 9 s
    "tests/advise/test_advise_robust.py::test_a_combination_that_cannot_run_is_left_out_with_its_reason_and_the_rest_ranked",  # 9 s
    "tests/compiled/test_compiled_training.py::test_a_compiled_step_with_its_optimizer_is_a_real_one[gpt2-adamw]",  # 9 s
    "tests/trainers/test_hf_trainer.py::test_trainer_step_matches_a_real_trainer_step[llama-lora]",  # 9 s
    "tests/distributed/test_distributed_capture.py::test_each_rank_holds_its_padded_shards[2-llama_gqa]",  # 9 s
    "tests/compiled/test_compiled.py::test_recomputed_ops_are_the_real_partitioners",  # 9 s
    "tests/planning/test_checkpoint_plans.py::test_plan_limits_are_checked",  # 9 s
    "tests/distributed/test_reuse_distributed.py::test_widened_rank_is_the_full_capture[fsdp_x_tp_sp_cuda]",  # 9 s
    "tests/planning/test_checkpoint_plans.py::test_identical_blocks_are_measured_at_depth_4_exactly[gpt2]",  # 9 s
    "tests/trainers/test_loop_options.py::test_cli_flags",  # 9 s
    "tests/compiled/test_compiled.py::test_formula_in_compiled_mode_matches_a_real_run",  # 8 s
    "tests/trainers/test_loop_options.py::test_options_change_the_peak_as_real_steps_do[hf_llama]",  # 8 s
    "tests/planning/test_checkpoint_plans.py::test_plan_peaks_match_real_cpu_runs[llama]",  # 8 s
    "tests/trainers/test_hf_trainer.py::test_trainer_step_matches_a_real_trainer_step[bert-classifier]",  # 8 s
)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Which CPU kernels the real steps run: a result depends on them (docs/validation.md)."""
    setting = isa.max_isa_setting() or "unset"
    how = "pinned by tests/conftest.py" if PINNED_ISA else "the CPU's own (GRAPHMEM_TEST_NATIVE_ISA=1)" \
        if NATIVE_ISA else "not pinned (no AVX2)"
    return [f"CPU kernels: oneDNN {isa.onednn_isa() or 'other'} (CPU {isa.hardware_isa() or 'other'}, "
            f"ONEDNN_MAX_CPU_ISA {setting}, {how}), ATen {torch.backends.cpu.get_cpu_capability()}, "
            f"bf16 GEMMs through oneDNN: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}"]


def pytest_configure(config: pytest.Config) -> None:
    """The pin took: torch had not computed its CPU capability before this file set it (something imported
    and ran torch first: set the two variables in the environment instead)."""
    if PINNED_ISA and os.environ["ATEN_CPU_CAPABILITY"] == "avx2" \
            and torch.backends.cpu.get_cpu_capability() != "AVX2":
        raise pytest.UsageError("tests/conftest.py set ATEN_CPU_CAPABILITY=avx2 after torch had read it; "
                                "run with ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 in the environment")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = pytest.mark.slow
    for item in items:  # a heavy case (pyproject.toml) is slow too: the quick command leaves it out
        if item.nodeid in SLOW_ON_TWO_CORES or item.get_closest_marker("heavy") is not None:
            item.add_marker(slow)
    kernels = isa.onednn_isa()
    bf16_gemm = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    avx512 = pytest.mark.skip(reason=f"a peak decided by oneDNN kernels graphmem models on AVX-512 only, not "
                                     f"the {kernels or 'other'} ones this process runs")
    off_x64 = pytest.mark.skip(reason="compares oneDNN rules for x86-64 AVX-512 and AVX2 kernels with this "
                                      "CPU's, which are neither")
    onednn_bf16 = pytest.mark.skip(reason="bf16 GEMMs run oneDNN here, whose scratch graphmem has no rule for "
                                          "(run without GRAPHMEM_TEST_NATIVE_ISA=1)")
    for item in items:
        if kernels != isa.AVX512 and item.nodeid.startswith(AVX512_KERNELS):
            item.add_marker(avx512)
        elif kernels not in (isa.AVX512, isa.AVX2) and item.nodeid.startswith(X64_KERNELS):
            item.add_marker(off_x64)
        elif bf16_gemm and item.nodeid.startswith(ONEDNN_BF16_GEMM):
            item.add_marker(onednn_bf16)
