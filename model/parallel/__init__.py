"""Scale-out inside one replica: process groups (`groups`), expert-parallel MoE and DEP
(`expert_parallel`), DEP learners' sharded expert adapters, their gathering and the global gradient
norm (`dep_learner`), decode-context-parallel MSA indexer and attention (`context_parallel`)."""
