"""Scale-out inside one replica: process groups (`groups`), expert-parallel MoE and DEP
(`expert_parallel`), DEP learners' sharded expert adapters, their gathering and the global gradient
norm (`dep_learner`), decode-context-parallel MSA indexer and attention and the engine's DCP cache
shard `DCPKVCache` (`context_parallel`). The engine replicas built on them live in rollout/native/
(dep.py, dcp.py); their Ray wiring in rl/replicas.py."""
