"""Pipeline parallelism with the MoE families (``pipeline_cases``): tiny-moe under expert parallelism
inside the stages (capacity and dropless, with tensor too), and tiny-deepseek (MLA + MoE) with its dense
prefix, which runs before the schedule, under every schedule.

Tolerances: ``pipeline_cases``' measured noise bound. The dense prefix's gradient is summed over the
stages' microbatches in another order than one device's running sum, which the rows-in-another-order
reference reproduces.
"""

from pipeline_cases import invariance_test

CASES = [
    ("tiny-moe", "gpipe", 2, 2, 1, "stage=2,data=2,expert=2"),
    ("tiny-moe", "1f1b", 2, 4, 1, "stage=2,expert=4"),
    ("tiny-moe", "interleaved", 2, 2, 2, "stage=2,expert=4"),
    ("tiny-moe", "zero_bubble", 2, 4, 1, "stage=2,fsdp=2,expert=2"),
    ("tiny-moe", "1f1b", 2, 2, 1, "stage=2,expert=2,tensor=2"),
    ("tiny-moe-dropless", "gpipe", 2, 2, 1, "stage=2,expert=2,tensor=2"),
    ("tiny-deepseek", "1f1b", 2, 2, 1, "stage=2,tensor=2"),
    ("tiny-deepseek", "zero_bubble", 2, 4, 1, "stage=2,data=2,expert=2"),
    ("tiny-deepseek", "interleaved", 2, 2, 2, "stage=2,expert=2,tensor=2"),
    ("tiny-deepseek", "gpipe", 4, 4, 1, "stage=4,fsdp=2"),
]

test_pipeline_equals_one_device = invariance_test(CASES)
