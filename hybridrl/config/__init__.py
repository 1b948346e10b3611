"""Job configuration: the dataclass schema, YAML + dotted overrides, and the derived `Plan`.

Torch-free by design: `hybridrl plan` and every config error come back in well under a second.
"""
from hybridrl.config.errors import ConfigError, ConfigIssue
from hybridrl.config.loader import config_from_dict, config_to_dict, load_config
from hybridrl.config.plan import Plan, build_plan, plan_from_sources
from hybridrl.config.schema import JobConfig

__all__ = [
    "ConfigError", "ConfigIssue", "JobConfig", "Plan",
    "build_plan", "plan_from_sources", "config_from_dict", "config_to_dict", "load_config",
]
