"""round_phases.phases(): how a thread's sync and poll events become rounds."""

from __future__ import annotations

from round_phases import phases


def test_rounds_are_cut_at_syncs_and_polls() -> None:
    events = [
        (0.0, "enter_epoll_pwait"),  # before the first sync: no round yet
        (5.0, "exit_epoll_pwait"),
        (10.0, "enter_fdatasync"),
        (200.0, "exit_fdatasync"),
        (300.0, "enter_epoll_pwait"),  # replies sent from 200 to 300
        (310.0, "exit_epoll_pwait"),
        (400.0, "enter_epoll_pwait"),  # a second turn of the loop
        (405.0, "exit_epoll_pwait"),
        (500.0, "enter_fdatasync"),
        (700.0, "exit_fdatasync"),
        (750.0, "enter_epoll_wait"),  # Redis's poll
        (760.0, "exit_epoll_wait"),
        (900.0, "enter_fdatasync"),
        (1000.0, "exit_fdatasync"),  # the recording ends inside a round
        (1010.0, "enter_epoll_wait"),
    ]
    assert phases(events) == [
        {"replies": 100.0, "poll": 15.0, "between": 90.0, "work": 95.0, "sync": 190.0},
        {"replies": 50.0, "poll": 10.0, "between": 0.0, "work": 140.0, "sync": 200.0},
    ]


def test_no_whole_round_without_two_syncs() -> None:
    events = [(0.0, "enter_fdatasync"), (100.0, "exit_fdatasync"), (150.0, "enter_epoll_pwait")]
    assert phases(events) == []
