"""The adamw rule's options (rules/adamw.py), each declared once: the AdamW step's, the round's
(its size, its backups) and DiLoCo's outer step's."""

from __future__ import annotations

from gemps_proto import rule_options
from gemps_proto.ranges import FLOAT32_MAX, INT32_MAX, Range
from gemps_proto.rule_options import RuleOption

# torch.optim.AdamW's defaults.
ADAM_BETA1 = RuleOption("adam_beta1", 0.9, Range(0, 1, high_open=True), "beta1: adamw's first-moment decay")
ADAM_BETA2 = RuleOption("adam_beta2", 0.999, Range(0, 1, high_open=True), "beta2: adamw's second-moment decay")
ADAM_EPSILON = RuleOption("adam_epsilon", 1e-8, Range(0, 1, low_open=True), "epsilon: adamw's denominator term")
ADAM_WEIGHT_DECAY = RuleOption(
    "adam_weight_decay", 0.01, Range(0, 1), "lambda: adamw's decoupled weight decay (see adam_decay_vectors)"
)
ROUND_SIZE = RuleOption(
    rule_options.ROUND_SIZE,
    0,
    Range(0, INT32_MAX),
    "K: adamw's commits a round (a step); 0: the workers registered less the backups",
)
ADAM_DECAY_VECTORS = RuleOption(
    "adam_decay_vectors",
    0,
    Range(0, 1),
    "1: adamw's weight decay on every parameter; 0: on tensors of 2 or more dimensions alone (nanoGPT's and "
    "the Trainer's groups: no biases, no norms' gains)",
)
GRADIENT_CLIP = RuleOption(
    "gradient_clip",
    0.0,
    Range(0, FLOAT32_MAX),
    "adamw's bound on the round's mean gradient's L2 norm, as DDP clips after its all-reduce; 0: none",
)
OUTER_RATE = RuleOption(
    rule_options.OUTER_RATE,
    0.0,
    Range(0, FLOAT32_MAX),
    "r: how adamw's round of updates (local steps) moves theta: 0, an AdamW step on their pseudo-gradient -delta; "
    "r > 0, DiLoCo's outer SGD at rate r (with outer_momentum) on it (1, no momentum: the models averaged)",
)
OUTER_MOMENTUM = RuleOption(
    "outer_momentum",
    0.0,
    Range(0, 1, high_open=True),
    "mu: with outer_rate r > 0, Nesterov momentum on the rounds of updates (DiLoCo's outer step, mu 0.9 "
    "and r 0.7 in its paper); 0: none",
)
BACKUP_WORKERS = RuleOption(
    "backup_workers",
    0,
    Range(0, INT32_MAX),
    "adamw's workers a round does not wait for (with round_size 0); their late gradients are dropped",
)

#: what shapes the AdamW step alone, which a round of updates under outer_rate never takes
ADAMW_STEP_OPTIONS = (ADAM_BETA1, ADAM_BETA2, ADAM_EPSILON, ADAM_WEIGHT_DECAY, ADAM_DECAY_VECTORS, GRADIENT_CLIP)
