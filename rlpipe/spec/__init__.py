"""The run spec: one YAML file, validated, with errors that say what to change.

Import from here (`from rlpipe.spec import RunSpec, parse_spec`); each concern has its module,
and they import in this order (each only the ones above it):

- section:    `section` and `setting` (how a section and its fields are declared), `retune`
- schema:     what a run learns from and how it samples: model, data, reward, rollout, samplers, preferences
- migration:  keys older versions read, refused with what to write instead
- algorithm:  `algorithm`: its name, the options every algorithm takes, and the registered algorithm's
              own options class (declared beside it in rlpipe.algorithms, looked up when a spec is parsed)
- training:   how the update trains and how long the loop runs: trainer, loop
- held_out:   what the held-out evals measure: sampled metrics, named sets, the evaluation harness
- placement:  where it runs and stores: storage, tracking, cluster and its pods
- sharing:    the trainer and samplers taking turns on one accelerator, runs taking turns by a lease
- run_spec:   RunSpec, the sections together, with the rules across sections
- validation: `parse_spec` and SpecError: unknown keys, types, bounds, choices, cross-field rules
- encoding:   YAML (`load_spec`, `with_overrides`), plain dicts and the JSON that crosses KFP; what
              the keys affect (TRAINING_KEYS, RESUMABLE_KEYS, WARM_START_KEYS) and `resume_changes`
- reference:  every key's type, default, bounds and doc (`spec_keys`), as docs/configuration.md's tables
              and a JSON Schema (`rlpipe schema`)

Steps parse the spec in every process, so this package imports nothing heavy.
"""

from rlpipe.spec.algorithm import (
    DEFAULT,
    OPTIONS,
    AlgorithmSpec,
    default_algorithm,
    not_an_option,
    options_class,
    options_classes,
    own_options,
    register_options,
)
from rlpipe.spec.encoding import (
    RESUMABLE_KEYS,
    TRAINING_KEYS,
    WARM_START_KEYS,
    flatten,
    load_spec,
    pick,
    resume_changes,
    section_dict,
    spec_from_json,
    spec_to_dict,
    spec_to_json,
    with_overrides,
    without,
)
from rlpipe.spec.held_out import EvalSetSpec, EvaluationSpec, HarnessSpec
from rlpipe.spec.migration import FLAT_ALGORITHM_DEFAULTS, old_gpu_keys, old_task_section, replaced_keys
from rlpipe.spec.placement import (
    CPU,
    MEMORY,
    ClusterSpec,
    ModelRegistrySpec,
    PodSpec,
    SecretEnv,
    StorageSpec,
    Toleration,
    TrackingSpec,
)
from rlpipe.spec.reference import (
    REFERENCE_BEGIN,
    REFERENCE_END,
    SCHEMA_FILE,
    SpecKey,
    json_schema,
    json_schema_text,
    reference_markdown,
    spec_keys,
    variants,
    with_reference,
)
from rlpipe.spec.run_spec import RunSpec
from rlpipe.spec.schema import (
    DataSpec,
    EnvironmentSpec,
    LoraSpec,
    ModelSpec,
    PreferencesSpec,
    RewardSpec,
    RolloutSpec,
    SamplersSpec,
    TinyModelSpec,
    WarmStartSpec,
)
from rlpipe.spec.section import retune, section, setting
from rlpipe.spec.sharing import DeviceClaimSpec, SharingSpec
from rlpipe.spec.training import LoopSpec, TrainerSpec
from rlpipe.spec.validation import SpecError, parse_spec

__all__ = [
    "CPU",
    "DEFAULT",
    "FLAT_ALGORITHM_DEFAULTS",
    "MEMORY",
    "OPTIONS",
    "REFERENCE_BEGIN",
    "REFERENCE_END",
    "RESUMABLE_KEYS",
    "TRAINING_KEYS",
    "WARM_START_KEYS",
    "AlgorithmSpec",
    "ClusterSpec",
    "DataSpec",
    "LoopSpec",
    "EnvironmentSpec",
    "EvalSetSpec",
    "EvaluationSpec",
    "HarnessSpec",
    "LoraSpec",
    "ModelRegistrySpec",
    "ModelSpec",
    "PodSpec",
    "PreferencesSpec",
    "RewardSpec",
    "RolloutSpec",
    "RunSpec",
    "SharingSpec",
    "DeviceClaimSpec",
    "SCHEMA_FILE",
    "SamplersSpec",
    "SecretEnv",
    "SpecError",
    "SpecKey",
    "StorageSpec",
    "TinyModelSpec",
    "Toleration",
    "TrackingSpec",
    "TrainerSpec",
    "WarmStartSpec",
    "default_algorithm",
    "flatten",
    "json_schema",
    "json_schema_text",
    "load_spec",
    "not_an_option",
    "old_gpu_keys",
    "old_task_section",
    "options_class",
    "options_classes",
    "own_options",
    "parse_spec",
    "pick",
    "reference_markdown",
    "register_options",
    "replaced_keys",
    "resume_changes",
    "retune",
    "section",
    "section_dict",
    "setting",
    "spec_from_json",
    "spec_keys",
    "spec_to_dict",
    "spec_to_json",
    "with_overrides",
    "variants",
    "with_reference",
    "without",
]
