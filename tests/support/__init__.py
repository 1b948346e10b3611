"""What the tests share and are not tests themselves: the fork launcher (`forked`), tiny models and jobs
(`models_fixtures`, `training_fixtures`, `rollout_models`), worker and rollout scenarios run inside forked ranks,
megatron helpers, and hosts as network namespaces (`netns_hosts`, `slurm_hosts`)."""
