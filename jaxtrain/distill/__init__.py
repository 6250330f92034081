"""On-policy distillation as pgs distill runs it (issue #22).

:mod:`~jaxtrain.distill.settings` reads the named sections, :mod:`~jaxtrain.distill.sources`
the prompt files, :mod:`~jaxtrain.distill.plan` checks tokenizers and vocabularies (the dry
run), :mod:`~jaxtrain.distill.rollout` samples the student, :mod:`~jaxtrain.distill.teachers`
(with :mod:`~jaxtrain.distill.teacher` and :mod:`~jaxtrain.distill.vllm_client`) scores,
:mod:`~jaxtrain.distill.scoring` builds micro-batches and the student's loss from
:mod:`~jaxtrain.distill.losses` (xtok's alignment: :mod:`~jaxtrain.distill.align`; shared
vocabularies: :mod:`~jaxtrain.distill.vocab`), and :mod:`~jaxtrain.distill.run` is the loop.
"""
