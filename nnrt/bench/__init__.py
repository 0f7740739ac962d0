"""``nnrt bench``: benchmarks (latency, accuracy, placement), the stress
test and the HTML report. Tools above the public API: they use ``nnrt`` as
an app does."""
from .results import Accuracy, Case, Sample, ShareSeries, Stats, StressResult  # noqa: F401
