"""What a cluster error quotes from a process's log when the process stopped: its last
error line, which precedes what a process logs on its way out, or else its last line;
from a kvtool command's log, its last line (kvtool's own one-line error)."""

from __future__ import annotations

from pathlib import Path

from kvtool.cluster.services import last_line, log_reason

MOONCAKE_EXIT = """\
I1203 00:51:27.984741 16271 client_service.cpp:423] client_id=1428-39163
E1203 00:51:32.254616 16291 master_client.cpp:361] Client not available
W1203 00:51:32.255514 16271 real_client.cpp:858] Failed to create client on port 13019
E1203 00:51:36.652801 16290 transfer_engine.cpp:88] Failed to bind 10.77.0.3:13349
I1203 00:51:36.761654 16271 real_client.cpp:901] dummy_client_monitor_thread stopped

"""


def test_the_last_glog_error_line_is_the_reason(tmp_path: Path) -> None:
    log = tmp_path / "mooncake-segment-b.log"
    log.write_text(MOONCAKE_EXIT)
    assert log_reason(log) == ("E1203 00:51:36.652801 16290 transfer_engine.cpp:88] Failed "
                               "to bind 10.77.0.3:13349")


def test_spdk_and_logging_errors_count_too(tmp_path: Path) -> None:
    log = tmp_path / "target.log"
    log.write_text("[2026-12-03 00:10:01] app.c: 712:spdk_app_start: *ERROR*: Unable to "
                   "acquire lock on assigned core mask\n[2026-12-03 00:10:01] app.c: "
                   "*NOTICE*: Exiting\n")
    assert log_reason(log).endswith("*ERROR*: Unable to acquire lock on assigned core mask")
    log.write_text("2026-12-03 00:10:01,123 ERROR worker.py:12 -- lost the GCS\nbye\n")
    assert log_reason(log) == "2026-12-03 00:10:01,123 ERROR worker.py:12 -- lost the GCS"


def test_without_an_error_line_the_last_line(tmp_path: Path) -> None:
    log = tmp_path / "ray.log"
    log.write_text("starting\nConnectionError: no route to 10.77.0.1:6379\n\n  \n")
    assert log_reason(log) == "ConnectionError: no route to 10.77.0.1:6379"
    log.write_text("x" * 300 + "\n")
    assert log_reason(log) == "x" * 200  # an error line fits one terminal line or two
    log.write_text("\n \n")
    assert log_reason(log) == "empty log"
    assert log_reason(tmp_path / "missing.log") == "no log"


def test_a_kvtool_command_s_log_gives_its_last_line(tmp_path: Path) -> None:
    log = tmp_path / "target-t0.log"
    log.write_text("app.c: *ERROR*: a line the target printed\n"
                   "kvtool: target up: port 4420 on 10.77.0.2 is taken (by pid 812)\n")
    assert last_line(log) == "kvtool: target up: port 4420 on 10.77.0.2 is taken (by pid 812)"
    assert log_reason(log) == "app.c: *ERROR*: a line the target printed"
    assert last_line(tmp_path / "missing.log") == "no log"
