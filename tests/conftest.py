"""Fixtures shared by the cross-process tests: unique segments, configs, agent processes."""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gwtest, under importlib mode

from gwtest import LOCK_FILE_ENV, NO_TIMEOUT_ENV, Agent, P1Segment, stopped_at_exit


@pytest.fixture
def segment_name() -> Iterator[str]:
    """A fresh segment name (removed afterwards, with its semaphores)."""
    from shm_layout.segment import unlink_segment

    name = "/gwt-" + secrets.token_hex(6)
    yield name
    unlink_segment(name)


@pytest.fixture
def key() -> str:
    """A unique, recognisable key, so a leak check can search every output for it (R-P7)."""
    return "sk-test-" + secrets.token_hex(16)


@pytest.fixture
def key_file(tmp_path: Path, key: str) -> Path:
    """``key`` in a 0600 file, newline-terminated as an editor leaves it."""
    path = tmp_path / "provider.key"
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def write_config(tmp_path: Path) -> Callable[..., Path]:
    def write(doc: dict[str, Any], name: str = "gateway.json") -> Path:
        path = tmp_path / name
        path.write_text(json.dumps(doc))
        return path

    return write


@pytest.fixture
def p1_segment(
    segment_name: str, write_config: Callable[..., Path], agents: Callable[..., Agent]
) -> Callable[..., P1Segment]:
    """``p1_segment(limit)``: ``segment_name`` and a config of one provider, p1, with that
    static limit (none: the default's); keyword arguments are the config's top-level
    fields (``maxConcurrent=99``)."""

    def make(limit: int | None = None, **gateway: Any) -> P1Segment:
        p1: dict[str, Any] = {"id": "p1"}
        if limit is not None:
            p1["maxConcurrent"] = limit
        return P1Segment(segment_name, write_config({**gateway, "providers": [p1]}), agents)

    return make


# --- macOS, and the darwin test mode (R-A10, docs/macos.md) ---------------------------------
# ``GATEWAY_CAPACITY_PLATFORM=darwin`` makes shm_layout.platform answer as macOS does, and
# raise where macOS has no such call; the processes a test starts inherit it. It stands
# in for a macOS kernel, which no machine of this project has: the calls both systems
# have run Linux's implementation. A test that needs a Linux feature itself (reading
# /dev/shm or /proc, unshare, systemd, the robust mutex, faketime...) says so with
# ``@pytest.mark.linux("what")``, and is skipped, with that reason, on macOS and in the
# darwin test mode. `make test` runs the admission, sidecar, CLI and ASGI suites a second
# time in the darwin test mode (Makefile: DARWIN_TESTS).
def _darwin_where() -> str | None:
    from shm_layout import platform

    if not platform.is_darwin():
        return None
    if sys.platform == "darwin":
        return "on macOS"
    return f"in the darwin test mode (${platform.PLATFORM_ENV}=darwin)"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "linux(reason): needs a Linux feature; skipped with the reason on macOS and in the "
        "darwin test mode",
    )


# --- the two tiers: `make check` runs `-m 'not slow'`, `make test` everything -------------
# A test is slow when it boots a container, builds a wheel, needs the litellm extra, or
# runs for more than a few seconds by design. Keys are node-id prefixes (a folder, a
# file, or one test); the value says why, and the mark carries it.
SLOW: dict[str, str] = {
    "tests/systemd/test_nspawn.py": "boots the unit in a Debian container",
    "tests/repo/test_wheel.py": "builds, repairs and installs a wheel",
    "tests/litellm/": "needs the litellm extra",
    "tests/asgi/test_retry_after_sdk.py": "needs the openai SDK of the litellm extra",
    "tests/soak/test_soak.py::test_r_a1_r_a2_r_a5_short_soak": "the soak's 20-second form",
    "tests/drill/test_upgrade_drill.py::test_upgrade_drill_short_form": "the drill's short form",
    "tests/demo/": "runs the demo (about 25 s a run)",
    "tests/share/test_share_gateways.py": "three sidecars, handlers and a redis-server a test",
    "tests/real/": "real llama-server processes (make real-workers)",
    "tests/repo/test_examples.py::test_r_k5_the_relay_walk_through": "a farm, router, "
    "sidecar and gateway, seven 3-second streams",
}


# Tests of real processes that take ten seconds or more on a busy 2-core machine (pytest
# --durations over the suite), each for a reason of its own: a gunicorn farm, a sidecar's
# refresh cycles, a hypothesis run of the core against its model, many CLI processes.
# `make check` leaves them to `make test`; its own tests stay under a few seconds each.
LONG: tuple[str, ...] = (
    "tests/admission/test_admission_cross_process.py::test_r_a1_stress_many_short_slots_from_8_processes_leave_nothing_behind",
    "tests/admission/test_admission_cross_process.py::test_r_a1_two_generations_never_exceed_the_limit",
    "tests/admission/test_admission_cross_process.py::test_r_a2_thirty_two_wait_and_the_thirty_third_is_rejected_at_once",
    "tests/admission/test_admission_cross_process.py::test_r_a3_waiters_are_admitted_in_arrival_order_across_processes",
    "tests/admission/test_admission_cross_process.py::test_r_a5_reuse_of_a_dead_process_registration_never_makes_it_look_alive",
    "tests/admission/test_admission_cross_process.py::test_r_a5_sigkill_of_a_running_holder_lets_a_waiter_in_within_2s",
    "tests/admission/test_admission_cross_process.py::test_r_a8_r_a9_r_g1_first_handler_creates_the_segment_with_static_limits",
    "tests/admission/test_darwin_mode.py::test_r_a10_the_darwin_mode_catches_a_linux_only_call_planted_in_shared_code",
    "tests/admission/test_split_budget.py::test_handler_on_another_path_warns_once_and_availability_shows_each_config_path",
    "tests/admission/test_wait_for_slot_local.py::test_r_w4_local_mode_room_busy_and_wait_then_room",
    "tests/asgi/test_asgi_middleware.py::test_gunicorn_hup_relabels_new_workers_and_shutdown_detaches",
    "tests/asgi/test_asgi_middleware.py::test_not_admitted_requests_pass_through_even_when_no_slot_can_be_had",
    "tests/asgi/test_asgi_middleware.py::test_r_a1_a_request_that_waited_gets_what_was_read_ahead_unchanged",
    "tests/asgi/test_asgi_middleware.py::test_r_a1_gunicorn_workers_share_one_budget",
    "tests/asgi/test_asgi_middleware.py::test_r_a4_client_that_goes_away_while_waiting_leaves_the_queue_at_once",
    "tests/asgi/test_by_model.py::test_by_model_an_upstream_id_is_admitted_and_unknown_or_missing_models_pass_through",
    "tests/asgi/test_by_model.py::test_by_model_refuses_an_oversize_body_413_and_a_body_that_is_not_a_json_object_400",
    "tests/asgi/test_by_model.py::test_r_a1_by_model_each_model_waits_on_its_own_providers_budget",
    "tests/asgi/test_by_model.py::test_r_a4_by_model_a_client_that_leaves_while_its_body_is_read_or_while_it_waits_leaves_nothing",
    "tests/fuzz/test_config_fuzz.py::test_r_c1_unknown_fields_anywhere_change_nothing",
    "tests/fuzz/test_contract_fuzz.py::test_r_k1_a_missing_or_wrong_required_field_is_invalid",
    "tests/fuzz/test_contract_fuzz.py::test_r_k1_r_k3_mutated_valid_documents_never_escape_the_limits",
    "tests/fuzz/test_contract_fuzz.py::test_r_k2_a_model_id_that_is_empty_or_over_256_characters_is_invalid",
    "tests/fuzz/test_contract_fuzz.py::test_r_k2_more_than_128_rows_or_a_duplicate_id_is_invalid",
    "tests/fuzz/test_contract_fuzz.py::test_r_k3_a_count_that_is_not_an_integer_0_to_4096_makes_the_snapshot_invalid",
    "tests/fuzz/test_contract_fuzz.py::test_r_k4_observed_at_must_be_finite",
    "tests/fuzz/test_contract_fuzz.py::test_r_k6_valid_documents_decode_with_unknown_fields_ignored_and_round_trip",
    "tests/limits/test_limits_properties.py::test_r_l2_r_l7_replicas_give_the_minimum_never_the_sum_and_expire_from_the_oldest",
    "tests/logs/test_log_format.py::test_router_serve_takes_log_format_and_timestamps_its_lines",
    "tests/probe/test_check_config_strict.py::test_strict_exits_1_and_lists_every_problem_of_a_provider",
    "tests/repo/test_examples.py::test_router_simworker_from_the_shell_serves_what_the_router_sums",
    "tests/repo/test_examples.py::test_router_simworker_openai_is_an_upstream_to_try_the_gateway_and_wait_for_slot",
    "tests/router/test_router_cli.py::test_r_k5_cli_refusals_exit_1_with_a_reason",
    "tests/router/test_router_cli.py::test_r_k5_fence_and_unfence_through_the_cli_drain_and_restore_a_worker",
    "tests/router/test_router_cli.py::test_serve_with_a_broken_registry_exits_2_with_one_line",
    "tests/shm/test_cli_args.py::test_a_max_heartbeat_age_or_watch_interval_of_zero_is_refused",
    "tests/shm/test_cli_args.py::test_a_mistyped_option_of_a_subcommand_prints_that_subcommands_usage",
    "tests/shm/test_cli_args.py::test_options_are_never_abbreviated_so_a_key_is_not_taken_for_a_path",
    "tests/shm/test_core_model.py::test_the_core_does_what_the_model_does",
    "tests/shm/test_lock_recovery.py::test_r_a11_a_gil_hog_in_a_holders_process_never_breaks_mutual_exclusion",
    "tests/shm/test_lock_recovery.py::test_r_a6_a_live_holder_is_never_robbed_however_long_it_is_stopped",
    "tests/shm/test_one_line_errors.py::test_a_damaged_segment_is_named_as_damaged",
    "tests/shm/test_segment.py::test_r_g5_segment_outlives_its_processes_and_unlink_refuses_while_live",
    "tests/shm/test_views_operator.py::test_check_is_0_while_the_sidecar_runs_and_1_once_it_was_killed",
    "tests/shm/test_views_operator.py::test_check_is_1_when_a_provider_fell_back_after_failing_discovery",
    "tests/shm/test_views_operator.py::test_check_is_1_while_the_sidecar_is_stopped_and_0_after_it_continues",
    "tests/shm/test_views_operator.py::test_json_mode_reports_errors_as_json_with_the_same_exit_code",
    "tests/sidecar/test_json_schema_e2e.py::test_every_json_output_carries_schema_version_and_validates",
    "tests/sidecar/test_json_schema_e2e.py::test_real_availability_and_inspect_output_validate_against_the_schemas",
    "tests/sidecar/test_sidecar_config_e2e.py::test_r_c3_broken_edit_keeps_the_last_good_config_and_availability_says_so",
    "tests/sidecar/test_sidecar_legacy_e2e.py::test_r_g3_legacy_drain_holds_new_work_until_the_legacy_process_exits",
    "tests/sidecar/test_sidecar_lifecycle_e2e.py::test_parent_pid_the_sidecar_exits_0_when_its_parent_exits",
    "tests/sidecar/test_sidecar_lifecycle_e2e.py::test_r_a5_the_sidecar_reclaims_a_sigkilled_holders_slot_within_2s",
    "tests/sidecar/test_sidecar_lifecycle_e2e.py::test_r_g4_a_second_sidecar_fences_the_first_which_exits_0_and_never_writes_again",
    "tests/sidecar/test_sidecar_lifecycle_e2e.py::test_r_g5_a_restarted_sidecar_reattaches_without_resetting_running_or_waiting",
    "tests/sidecar/test_sidecar_lifecycle_e2e.py::test_r_l7_r_a9_after_sigkill_handlers_keep_the_discovered_limit_until_expiry_then_fallback",
    "tests/sidecar/test_sidecar_lifecycle_e2e.py::test_stop_signal_exits_0_leaves_the_segment_and_handlers_keep_working",
    "tests/sidecar/test_sidecar_limits_e2e.py::test_r_l2_r_l4_limit_follows_the_router_20_10_20_and_handlers_follow_it",
    "tests/sidecar/test_sidecar_limits_e2e.py::test_r_l4_r_l9_discovered_limit_is_capped_and_the_reason_says_what_capped_it",
    "tests/sidecar/test_sidecar_limits_e2e.py::test_r_l8_complete_snapshot_without_the_model_gives_zero_and_new_work_waits",
    "tests/sidecar/test_sidecar_ops_e2e.py::test_r_g4_an_unusable_metrics_address_exits_2_without_fencing_the_running_sidecar",
    "tests/sidecar/test_sidecar_ops_e2e.py::test_r_p7_json_logs_are_one_object_a_line_and_the_key_appears_nowhere",
    "tests/verify/test_verify.py::test_an_unreachable_router_is_named_by_its_url_with_the_port_and_a_missing_value_is_a_dash",
    "tests/verify/test_verify.py::test_r_l3_a_model_typo_is_a_sidecar_warning_and_verify_exits_1",
    "tests/verify/test_verify.py::test_verify_agrees_then_differs_and_never_shows_the_key",
    "tests/verify/test_verify.py::test_verify_and_check_config_with_a_segment_alone_use_the_config_it_was_made_for",
    "tests/verify/test_verify.py::test_verify_that_could_not_compare_exits_2_never_ok",
    "tests/wait_for_slot/test_wfs_metrics_mode.py::test_installed_command_exits_0_1_2_as_a_real_process",
)
LONG_REASON = "ten seconds or more of real processes (tests/conftest.py: LONG)"


def _slow_reason(nodeid: str) -> str | None:
    for prefix, why in SLOW.items():
        if nodeid.startswith(prefix):
            return why
    test = nodeid.split("[", 1)[0]
    if test in LONG:
        return LONG_REASON
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        why = _slow_reason(item.nodeid)
        if why is not None:
            item.add_marker(pytest.mark.slow(why))
    where = _darwin_where()
    if where is None:
        return
    for item in items:
        mark = item.get_closest_marker("linux")
        if mark is not None:
            reason = mark.args[0] if mark.args else "a Linux feature"
            item.add_marker(pytest.mark.skip(reason=f"needs Linux: {reason} (skipped {where})"))


@pytest.fixture(params=["robust-mutex", "lock-file"])
def lock_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on both lock kinds (``layout.LOCK_KINDS``): ``robust-mutex``, Linux's own
    path (a robust mutex in the segment, semaphore timeouts available), and ``lock-file``,
    the path macOS takes, forced here (a lock file beside the segment, no semaphore
    timeouts: R-A10). Segments created under the test use that lock; every process
    attaching follows what the segment's header says. On macOS and in the darwin test
    mode there is only the lock file: the "robust-mutex" run is skipped."""
    where = _darwin_where()
    if request.param == "robust-mutex" and where is not None:
        pytest.skip(f"the Linux path (robust mutex, timed semaphore waits) does not exist {where}")
    if request.param == "lock-file":
        monkeypatch.setenv(NO_TIMEOUT_ENV, "1")
        monkeypatch.setenv(LOCK_FILE_ENV, "1")
    else:
        monkeypatch.delenv(NO_TIMEOUT_ENV, raising=False)
        monkeypatch.delenv(LOCK_FILE_ENV, raising=False)
    return str(request.param)


@pytest.fixture
def agents() -> Iterator[Callable[..., Agent]]:
    """Start tests/agent.py processes; every one is killed afterwards."""
    with stopped_at_exit(Agent.kill) as keep:
        yield lambda *args, env=None: keep(Agent(list(args), env=env))


# Modules whose tests share one expensive module-scoped fixture (a booted
# container, a built wheel: two builds at once in one checkout race on its
# egg-info): all their tests go to one xdist worker, in order. xdist's own
# --dist loadgroup does not group under pytest 9 (it renames node ids, which
# pytest 9 no longer reads back), so the scheduler is chosen here.
ONE_WORKER_MODULES = ("tests/systemd/test_nspawn.py::", "tests/repo/test_wheel.py::")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class _Scheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            for prefix in ONE_WORKER_MODULES:
                if nodeid.startswith(prefix):
                    return prefix
            return nodeid  # every other test is its own unit, as with --dist load

    return _Scheduling(config, log)
