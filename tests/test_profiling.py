"""``exp_manager.profile_steps``: torch.profiler over a window of optimizer steps, a trace and a table per rank."""

from __future__ import annotations

import json
import stat
from collections import Counter

import pytest
from test_train_e2e import TINY, assert_ok, nxdt

from nxdt.config import compose_config
from nxdt.config.validate import ConfigError
from nxdt.lightning.profiling import busy_seconds

pytestmark = pytest.mark.timeout(300)


def test_the_window_holds_exactly_its_steps_on_every_rank(tmp_path):
    run = tmp_path / "run"
    result = nxdt(
        "train",
        *TINY,
        "data=synthetic",
        "trainer.devices=2",
        "trainer.max_steps=3",
        "exp_manager.save_last=false",
        "exp_manager.profile_steps=[2,2]",
        f"exp_manager.explicit_log_dir={run}",
        cwd=tmp_path,
    )
    assert_ok(result)
    for rank in (0, 1):
        trace = json.loads((run / "profile" / f"rank{rank}.json").read_text())
        names = Counter(e.get("name") for e in trace["traceEvents"])
        assert names["Optimizer.step#AdamW.step"] == 1, names.most_common(10)  # step 2, not 1 or 3
        table = (run / "profile" / f"rank{rank}.txt").read_text()
        assert table.startswith(f"step 2 on rank {rank} (cpu): ") and "aten::mm" in table, table[:500]
        for name in (f"rank{rank}.json", f"rank{rank}.txt"):  # run files are private to their user
            assert stat.S_IMODE((run / "profile" / name).stat().st_mode) & 0o077 == 0


@pytest.mark.parametrize("steps", ["[3,2]", "[2]", "[0,1]", "[1,9]"])
def test_a_window_outside_the_run_is_one_line_before_anything_starts(steps):
    with pytest.raises(ConfigError) as err:
        compose_config(["trainer.max_steps=8", f"exp_manager.profile_steps={steps}"])
    assert str(err.value).startswith("config error: exp_manager.profile_steps=") and "\n" not in str(err.value)
    assert "1 <= first <= last <= trainer.max_steps=8" in str(err.value)


def test_busy_time_is_the_union_of_the_device_intervals():
    assert busy_seconds([]) == 0
    assert busy_seconds([(0, 2), (1, 3), (5, 6), (5.5, 5.75)]) == 4  # overlaps counted once, the gap not at all
