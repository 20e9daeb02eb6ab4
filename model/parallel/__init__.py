"""Scale-out inside one replica: process groups (`groups`), expert-parallel MoE and DEP
(`expert_parallel`), decode-context-parallel MSA indexer and attention (`context_parallel`)."""
