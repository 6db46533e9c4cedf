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

import owned
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
    # A test owns what it starts, however the session ends (tests/owned.py): what a
    # pytest process killed outright left is killed by the next session, at its start.
    # xdist's controller owns its workers (they carry its token), each worker its tests'.
    if not hasattr(config, "workerinput"):
        for line in owned.sweep_orphans():
            print(f"killed, left by a pytest process that is gone: {line}", file=sys.stderr)
    owned.own_what_starts()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _xdist_controller(session.config):
        return  # its workers are still ending; its reaper sweeps after them
    for line in owned.sweep_leftovers():
        print(f"killed, still running at the session's end: {line}", file=sys.stderr)


def _xdist_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", 0))


def pytest_unconfigure(config: pytest.Config) -> None:
    owned.let_go()


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
    "tests/share/test_share_faults.py": "two sidecars, handlers and a redis-server a test, "
    "each through a fault past a lease (about 35 s for the file on 2 cores)",
    "tests/share/test_share_model.py": "a hypothesis run of the share rules under every fault",
    "tests/share/test_share_sentinel.py": "a master, a replica, three sentinels and two "
    "gateways a test, through a failover or an outage (about 100 s for the file on 2 cores)",
    "tests/real/": "real inference servers (make real-workers)",
    "tests/repo/test_examples.py::test_r_k5_the_relay_walk_through": "a farm, router, "
    "sidecar and gateway, seven 3-second streams",
    "tests/repo/test_readme_counts.py": "collects the whole suite (a minute on a busy machine)",
    "tests/share/test_share_fallback_words.py": "a sidecar and a redis-server",
    "tests/repo/test_owned.py": "starts pytest runs and kills them (a minute a test at load 30)",
}


# Tests of real processes that take two seconds or more on a busy 2-core machine (pytest
# --durations=0 over `make check`), each for a reason of its own: a timeout or grace that
# must pass (a 3 s probe deadline, a 10 s close grace, a paused holder), a gunicorn farm,
# a sidecar's refresh cycles, a hypothesis run of the core against its model, many CLI
# processes. `make check` leaves them to `make test`, which runs them all: the fast tier
# keeps the tests of about a second or less, so that it stays under 2 minutes on 2 cores.
# tests/repo/test_test_tiers.py checks that every entry still names a test.
LONG: tuple[str, ...] = (
    "tests/admission/test_acquire_release.py::test_release_after_close_is_a_no_op",
    "tests/admission/test_admission_cross_process.py::test_r_a1_stress_many_short_slots_from_8_processes_leave_nothing_behind",
    "tests/admission/test_classes_cross_process.py::test_r_a18_r_a21_a_batch_flood_from_8_processes_of_two_generations_leaves_the_reserve",
    "tests/admission/test_classes_cross_process.py::test_r_a5_r_a18_a_sigkilled_holder_of_a_reserved_slot_gives_it_to_its_class",
    "tests/admission/test_classes_cross_process.py::test_r_a22_wait_for_slot_computes_room_as_the_class_sees_it",
    "tests/sidecar/test_sidecar_classes_e2e.py::test_r_a17_r_c4_the_sidecar_writes_the_classes_and_follows_their_edits",
    "tests/sidecar/test_sidecar_classes_e2e.py::test_r_a17_r_c3_a_bad_class_entry_is_loud_everywhere_and_costs_the_classes_only",
    "tests/wait_for_slot/test_wfs_classes.py::test_r_a22_without_class_it_gates_as_the_default_class_and_a_need_over_a_cap_is_refused",
    "tests/router/test_check_config_probe.py::test_a_probe_that_leaves_the_limit_at_0_is_not_ok_and_fails_the_check",
    "tests/admission/test_admission_cross_process.py::test_r_a1_two_generations_never_exceed_the_limit",
    "tests/admission/test_admission_cross_process.py::test_r_a2_thirty_two_wait_and_the_thirty_third_is_rejected_at_once",
    "tests/admission/test_admission_cross_process.py::test_r_a3_waiters_are_admitted_in_arrival_order_across_processes",
    "tests/admission/test_admission_cross_process.py::test_r_a5_reuse_of_a_dead_process_registration_never_makes_it_look_alive",
    "tests/admission/test_admission_cross_process.py::test_r_a5_sigkill_of_a_running_holder_lets_a_waiter_in_within_2s",
    "tests/admission/test_admission_cross_process.py::test_r_a8_r_a9_r_g1_first_handler_creates_the_segment_with_static_limits",
    "tests/admission/test_admission_in_process.py::test_r_a7_a_waiting_process_wakes_at_most_10_times_a_second",
    "tests/admission/test_admission_in_process.py::test_slots_held_at_close_are_released",
    "tests/admission/test_another_user_first.py::test_r_g6_every_view_and_the_sidecar_refuse_a_symbolic_link_without_a_traceback",
    "tests/admission/test_darwin_mode.py::test_r_a10_the_darwin_mode_catches_a_linux_only_call_planted_in_shared_code",
    "tests/admission/test_interrupts_and_loops.py::test_r_a11_a_stopped_lock_holder_never_freezes_the_event_loop",
    "tests/admission/test_interrupts_and_loops.py::test_r_a12_a_sigint_storm_leaves_no_record_in_a_process_that_goes_on",
    "tests/admission/test_limit_after_a_stalled_lock.py::test_r_a1_an_expired_publication_is_not_applied_after_a_stalled_lock",
    "tests/admission/test_liveness_kernel_held.py::test_r_a5_a_holder_paused_longer_than_any_timeout_is_alive",
    "tests/admission/test_liveness_kernel_held.py::test_r_a5_holders_in_another_pid_namespace_are_alive",
    "tests/admission/test_lock_target_descriptors.py::test_r_a1_a_second_attach_or_a_reader_in_a_holding_process_keeps_its_slot",
    "tests/admission/test_moments_of_change.py::test_r_a12_a_signal_storm_lets_no_foreign_exception_out_of_slot_blocking",
    "tests/admission/test_moments_of_change.py::test_r_a15_a_segment_removed_by_hand_never_splits_the_budget",
    "tests/admission/test_moments_of_change.py::test_r_a16_a_bad_write_to_an_in_use_word_never_refuses_new_handlers",
    "tests/admission/test_moments_of_change.py::test_r_l7_a_stepped_wall_clock_neither_extends_nor_cuts_a_published_limit",
    "tests/admission/test_split_budget.py::test_handler_on_another_path_warns_once_and_availability_shows_each_config_path",
    "tests/admission/test_truncated_segment.py::test_r_a15_a_handler_survives_its_segment_truncated_to_nothing_by_root",
    "tests/admission/test_truncated_segment.py::test_r_g6_a_group_member_truncating_the_segment_kills_no_handler",
    "tests/admission/test_wait_for_slot_local.py::test_r_w4_a_need_above_what_the_limit_can_ever_reach_exits_2_at_once",
    "tests/admission/test_wait_for_slot_local.py::test_r_w4_local_mode_room_busy_and_wait_then_room",
    "tests/asgi/test_asgi_middleware.py::test_client_gone_mid_stream_releases_the_slot",
    "tests/asgi/test_asgi_middleware.py::test_gunicorn_hup_relabels_new_workers_and_shutdown_detaches",
    "tests/asgi/test_asgi_middleware.py::test_not_admitted_requests_pass_through_even_when_no_slot_can_be_had",
    "tests/asgi/test_asgi_middleware.py::test_r_a1_a_request_that_waited_gets_what_was_read_ahead_unchanged",
    "tests/asgi/test_asgi_middleware.py::test_r_a1_gunicorn_workers_share_one_budget",
    "tests/asgi/test_asgi_middleware.py::test_r_a1_streamed_response_holds_the_slot_until_its_last_byte",
    "tests/asgi/test_asgi_middleware.py::test_r_a2_overflow_answers_429_with_retry_after_and_an_openai_error_body",
    "tests/asgi/test_asgi_middleware.py::test_r_a4_admission_timeout_answers_503_and_leaves_nothing_queued",
    "tests/asgi/test_asgi_middleware.py::test_r_a4_client_that_goes_away_while_waiting_leaves_the_queue_at_once",
    "tests/asgi/test_by_model.py::test_by_model_an_upstream_id_is_admitted_and_unknown_or_missing_models_pass_through",
    "tests/asgi/test_by_model.py::test_by_model_refuses_an_oversize_body_413_and_a_body_that_is_not_a_json_object_400",
    "tests/asgi/test_by_model.py::test_by_model_table_a_request_whose_model_cannot_be_read_goes_to_the_named_default",
    "tests/asgi/test_by_model.py::test_r_a1_by_model_each_model_waits_on_its_own_providers_budget",
    "tests/asgi/test_by_model.py::test_r_a1_by_model_table_the_path_or_query_model_wins_and_forms_are_read_by_their_fields",
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
    "tests/probe/test_addresses.py::test_r_p8_a_hanging_resolver_holds_one_thread_and_never_starves_other_providers",
    "tests/probe/test_check_config_strict.py::test_strict_exits_1_and_lists_every_problem_of_a_provider",
    "tests/probe/test_probe_matrix.py::test_r_p5_dripping_server_ends_at_the_three_second_deadline",
    "tests/probe/test_probe_matrix.py::test_r_p5_hung_resolver_cannot_hold_the_deadline_hostage",
    "tests/probe/test_probe_matrix.py::test_r_p5_server_that_never_answers_times_out",
    "tests/probe/test_probe_matrix.py::test_r_p8_slow_providers_are_probed_concurrently",
    "tests/repo/test_doc_snippets.py::test_every_python_snippet_in_the_docs_runs_as_pasted",
    "tests/repo/test_examples.py::test_r_k5_the_farm_walk_through_runs_as_pasted_and_follows_the_drain",
    "tests/repo/test_examples.py::test_r_l5_the_openai_walk_through_runs_as_pasted_and_stays_on_the_static_fallback",
    "tests/repo/test_examples.py::test_router_simworker_from_the_shell_serves_what_the_router_sums",
    "tests/repo/test_examples.py::test_router_simworker_openai_is_an_upstream_to_try_the_gateway_and_wait_for_slot",
    "tests/router/test_check_config_probe.py::test_probe_reads_the_real_router_and_says_what_to_do_about_each_mistake",
    "tests/repo/test_packaging.py::test_only_a_test_build_of_the_core_has_its_test_entry_points",
    "tests/router/test_router_cli.py::test_r_k5_cli_refusals_exit_1_with_a_reason",
    "tests/router/test_router_cli.py::test_r_k5_fence_and_unfence_through_the_cli_drain_and_restore_a_worker",
    "tests/router/test_router_cli.py::test_r_k5_show_and_the_log_escape_what_a_worker_says",
    "tests/router/test_router_cli.py::test_r_k5_simworker_shapes_behind_serve_give_a_discovered_limit_and_show_says_which",
    "tests/router/test_router_cli.py::test_r_k5_two_workers_on_one_socket_address_are_a_warning_in_check_show_and_the_log",
    "tests/router/test_router_cli.py::test_r_p6_a_registry_whose_snapshot_could_pass_64_kib_is_refused_saying_why",
    "tests/router/test_router_cli.py::test_serve_with_a_broken_registry_exits_2_with_one_line",
    "tests/router/test_router_proxy.py::test_r_k5_router_serve_relays_a_stream_from_a_simworker_process",
    "tests/router/test_router_metrics.py::test_r_k5_metrics_count_the_relayed_requests_and_the_workers_own_figures",
    "tests/router/test_router_relay_attacks.py::test_r_k5_idle_sockets_of_nobody_do_not_stop_the_key_holder",
    "tests/router/test_router_relay_attacks.py::test_r_k5_capacity_is_polled_on_time_while_the_relay_is_at_its_limit",
    "tests/router/test_router_relay_attacks.py::test_r_k5_a_round_without_a_descriptor_publishes_no_count_for_the_worker",
    "tests/share/test_share_credential.py::test_share_metrics_say_whether_redis_answers",
    "tests/share/test_share_credential.py::test_share_refuses_a_redis_password_in_the_urls_query",
    "tests/share/test_share_credential.py::test_share_refuses_a_redis_url_that_redis_py_would_not_build_or_that_sets_its_timeouts",
    "tests/share/test_share_credential.py::test_share_reads_the_redis_password_from_its_file_and_never_shows_it",
    "tests/share/test_share_credential.py::test_share_with_a_wrong_password_holds_no_share_and_fails_the_check",
    "tests/shm/test_cli_args.py::test_a_max_heartbeat_age_or_watch_interval_of_zero_is_refused",
    "tests/shm/test_cli_args.py::test_a_mistyped_option_names_the_option_it_resembles_and_shows_a_file_value",
    "tests/shm/test_cli_args.py::test_a_mistyped_option_of_a_subcommand_prints_that_subcommands_usage",
    "tests/shm/test_cli_args.py::test_options_are_never_abbreviated_so_a_key_is_not_taken_for_a_path",
    "tests/shm/test_cli_args.py::test_unrecognized_arguments_are_refused_without_being_shown",
    "tests/shm/test_core_model.py::test_the_core_does_what_the_model_does",
    "tests/shm/test_lock_recovery.py::test_r_a11_a_gil_hog_in_a_holders_process_never_breaks_mutual_exclusion",
    "tests/shm/test_lock_recovery.py::test_r_a6_a_live_holder_is_never_robbed_however_long_it_is_stopped",
    "tests/shm/test_lock_recovery.py::test_r_a6_counters_are_repaired_from_holder_records",
    "tests/shm/test_one_line_errors.py::test_a_damaged_segment_is_named_as_damaged",
    "tests/shm/test_one_line_errors.py::test_the_129th_attach_says_the_table_is_full_and_nothing_else",
    "tests/shm/test_segment.py::test_availability_without_a_segment_exits_3_with_one_line",
    "tests/shm/test_segment.py::test_r_g2_create_attach_race_between_many_processes_has_one_creator",
    "tests/shm/test_segment.py::test_r_g2_processes_that_find_an_abandoned_segment_together_end_on_one",
    "tests/shm/test_segment.py::test_r_g2_segment_abandoned_before_init_is_recreated",
    "tests/shm/test_segment.py::test_r_g5_segment_outlives_its_processes_and_unlink_refuses_while_live",
    "tests/shm/test_segment.py::test_r_g5_unlink_force_removes_a_segment_in_use",
    "tests/shm/test_segment.py::test_watch_refreshes_the_availability_view",
    "tests/shm/test_views_operator.py::test_a_segment_name_one_character_off_names_the_segment_that_exists",
    "tests/shm/test_views_operator.py::test_a_reason_longer_than_the_segment_keeps_is_shown_whole_in_every_view",
    "tests/shm/test_views_operator.py::test_check_is_0_while_the_sidecar_runs_and_1_once_it_was_killed",
    "tests/shm/test_views_operator.py::test_check_is_1_for_a_segment_of_another_user_naming_both_fixes",
    "tests/shm/test_views_operator.py::test_check_is_1_when_a_provider_fell_back_after_failing_discovery",
    "tests/shm/test_views_operator.py::test_check_is_1_while_the_config_on_disk_is_broken_and_0_once_fixed",
    "tests/shm/test_views_operator.py::test_check_is_1_while_the_sidecar_is_stopped_and_0_after_it_continues",
    "tests/shm/test_views_operator.py::test_check_warns_with_exit_4_of_a_provider_held_at_limit_0",
    "tests/shm/test_views_operator.py::test_json_mode_reports_errors_as_json_with_the_same_exit_code",
    "tests/shm/test_views_operator.py::test_unlink_force_on_a_world_accessible_segment_says_one_true_thing",
    "tests/sidecar/test_json_schema_e2e.py::test_every_json_output_carries_schema_version_and_validates",
    "tests/sidecar/test_json_schema_e2e.py::test_real_availability_and_inspect_output_validate_against_the_schemas",
    "tests/sidecar/test_metrics_e2e.py::test_discovery_failure_and_a_broken_edit_show_as_reasons_and_absent_series",
    "tests/sidecar/test_metrics_e2e.py::test_metrics_only_on_slash_metrics_and_healthz_apart",
    "tests/sidecar/test_sidecar_as_a_child.py::test_parent_pid_a_sidecar_whose_supervisor_is_killed_stops_cleanly",
    "tests/sidecar/test_sidecar_config_e2e.py::test_r_c3_broken_edit_keeps_the_last_good_config_and_availability_says_so",
    "tests/sidecar/test_sidecar_config_e2e.py::test_r_c3_config_unusable_at_start_exits_2_with_one_clear_line",
    "tests/sidecar/test_sidecar_config_e2e.py::test_r_c4_toggling_capacity_discovery_is_followed_live_and_r_c1_file_is_never_written",
    "tests/sidecar/test_sidecar_config_e2e.py::test_r_p9_a_config_edit_probes_at_once_and_providers_come_and_go",
    "tests/sidecar/test_sidecar_legacy_e2e.py::test_r_g3_legacy_drain_holds_new_work_until_the_legacy_process_exits",
    "tests/sidecar/test_sidecar_lifecycle_e2e.py::test_parent_pid_the_sidecar_exits_0_when_its_parent_exits",
    "tests/sidecar/test_sidecar_lifecycle_e2e.py::test_r_a5_the_sidecar_reclaims_a_sigkilled_holders_slot_within_2s",
    "tests/sidecar/test_sidecar_lifecycle_e2e.py::test_r_g4_a_second_sidecar_fences_the_first_which_exits_0_and_never_writes_again",
    "tests/sidecar/test_sidecar_lifecycle_e2e.py::test_r_g5_a_restarted_sidecar_reattaches_without_resetting_running_or_waiting",
    "tests/sidecar/test_sidecar_lifecycle_e2e.py::test_r_g6_the_sidecar_creates_the_segment_owner_only_unless_group_shared",
    "tests/sidecar/test_sidecar_lifecycle_e2e.py::test_r_l7_r_a9_after_sigkill_handlers_keep_the_discovered_limit_until_expiry_then_fallback",
    "tests/sidecar/test_sidecar_lifecycle_e2e.py::test_stop_signal_exits_0_leaves_the_segment_and_handlers_keep_working",
    "tests/sidecar/test_sidecar_limits_e2e.py::test_r_l2_r_l4_limit_follows_the_router_20_10_20_and_handlers_follow_it",
    "tests/sidecar/test_sidecar_limits_e2e.py::test_r_l4_r_l9_discovered_limit_is_capped_and_the_reason_says_what_capped_it",
    "tests/sidecar/test_sidecar_limits_e2e.py::test_r_l5_every_failure_reason_reaches_availability_with_the_fallback",
    "tests/sidecar/test_sidecar_limits_e2e.py::test_r_l6_incomplete_answers_can_lower_but_never_raise_the_limit",
    "tests/sidecar/test_sidecar_limits_e2e.py::test_r_l8_complete_snapshot_without_the_model_gives_zero_and_new_work_waits",
    "tests/sidecar/test_sidecar_ops_e2e.py::test_r_g4_an_unusable_metrics_address_exits_2_without_fencing_the_running_sidecar",
    "tests/sidecar/test_sidecar_ops_e2e.py::test_r_p7_json_logs_are_one_object_a_line_and_the_key_appears_nowhere",
    "tests/sidecar/test_sidecar_robustness_e2e.py::test_r_g3_a_drain_never_lapses_between_refreshes",
    "tests/sidecar/test_sidecar_robustness_e2e.py::test_r_g4_a_sidecar_whose_segment_was_removed_exits_1_instead_of_running_dark",
    "tests/sidecar/test_sidecar_robustness_e2e.py::test_r_p9_touching_the_config_neither_discards_probes_nor_floods_the_log",
    "tests/sidecar/test_sidecar_systemd_e2e.py::test_status_line_carries_each_providers_limit_and_follows_changes",
    "tests/sidecar/test_sidecar_trust_e2e.py::test_r_g3_a_drain_longer_than_await_legacy_max_warns_once_and_fails_the_check",
    "tests/sidecar/test_sidecar_trust_e2e.py::test_r_g3_await_legacy_may_not_name_pid_1",
    "tests/sidecar/test_sidecar_trust_e2e.py::test_r_g3_await_legacy_may_not_name_the_parent_pid",
    "tests/sidecar/test_sidecar_trust_e2e.py::test_r_g6_a_pidfile_of_a_user_nobody_named_stays_refused_under_owner",
    "tests/soak/test_soak.py::test_r_a1_soak_check_fails_when_told_the_limits_were_lower",
    "tests/verify/test_verify.py::test_an_unreachable_router_is_named_by_its_url_with_the_port_and_a_missing_value_is_a_dash",
    "tests/verify/test_verify.py::test_r_l3_a_model_typo_is_a_sidecar_warning_and_verify_exits_1",
    "tests/verify/test_verify.py::test_verify_agrees_then_differs_and_never_shows_the_key",
    "tests/verify/test_verify.py::test_verify_and_check_config_with_a_segment_alone_use_the_config_it_was_made_for",
    "tests/verify/test_verify.py::test_verify_that_could_not_compare_exits_2_never_ok",
    "tests/wait_for_slot/test_wfs_metrics_mode.py::test_installed_command_exits_0_1_2_as_a_real_process",
    "tests/wait_for_slot/test_wfs_metrics_mode.py::test_r_w1_gives_up_after_max_wait_with_exit_1",
)
LONG_REASON = "two seconds or more of real processes (tests/conftest.py: LONG)"


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
# pytest 9 does not read back), so the scheduler is chosen here.
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
