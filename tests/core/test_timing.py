"""The timer compiling asks (``autofuser_core.timing``): the GPU's by default, another
one inside ``using``, and the previous one back after it, also when the block raises."""

from __future__ import annotations

import pytest
import torch

from autofuser_core import timing
from autofuser_core.fuse import FuseOptions

from _helpers import StandInTimer


def test_the_default_timer_tunes_and_times_only_on_a_gpu_and_when_asked():
    timer = timing.current()
    assert type(timer) is timing.Timer
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert not timer.can_tune(cpu, FuseOptions()) and not timer.can_time(cpu, FuseOptions())
    assert timer.can_tune(gpu, FuseOptions()) and timer.can_time(gpu, FuseOptions())
    assert not timer.can_tune(gpu, FuseOptions(tune=False))
    assert not timer.can_time(gpu, FuseOptions(verify_speed=False))


def test_using_puts_a_timer_in_place_and_the_previous_one_back():
    default = timing.current()
    outer, inner = StandInTimer(), StandInTimer(lambda fn, *args: 2.5)
    with timing.using(outer) as entered:
        assert entered is outer and timing.current() is outer
        with pytest.raises(RuntimeError), timing.using(inner):
            assert timing.current().bench(lambda: None) == 2.5
            raise RuntimeError("the block fails")
        assert timing.current() is outer
    assert timing.current() is default
    assert len(inner.timed) == 1 and not outer.timed


def test_use_timer_holds_for_the_rest_of_the_test(use_timer):
    timer = use_timer(StandInTimer(tune=False, time=True))
    assert timing.current() is timer
    assert not timer.can_tune(torch.device("cpu"), FuseOptions())
    assert timer.can_time(torch.device("cpu"), FuseOptions())
