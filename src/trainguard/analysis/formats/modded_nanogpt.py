"""modded-nanogpt's logs: `step:N/M train_loss:X train_time:...` and `step:N/M val_loss:X ...`
(a log may open with the source code of the run, which is passed over)."""

from __future__ import annotations

from trainguard.analysis.formats.lines import LineFormat, pattern

FORMAT = LineFormat(
    "modded_nanogpt",
    "modded-nanogpt logs (step:N/M train_loss:X; step:N/M val_loss:X)",
    train=(pattern(r"^step:(?P<step>\d+)/\d+\s+train_loss:(?P<loss>{N})"),),
    evals=(pattern(r"^step:(?P<step>\d+)/\d+\s+val_loss:(?P<loss>{N})"),),
).log_format()
