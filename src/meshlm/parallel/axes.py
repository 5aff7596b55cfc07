"""Mesh axis names: the only place these strings are spelled as axes (JSON reports reuse the words
"dp"/"mp" as keys, which are output names, not axis lookups).

The mesh is 2-D: ``DP`` splits the batch (data parallel), ``MP`` splits weights Megatron-style
(model / tensor parallel); with a pipeline (``--pp``) ``PP`` is a third, outermost axis over which
the stacked layers are split into stages. Layers never name axes; they call methods of
``meshlm.parallel.context.Parallel``.
"""

DP = "dp"  # data-parallel axis: the global batch is split over it
MP = "mp"  # model-parallel axis: heads, hidden units and the vocabulary are split over it
MESH_AXES = (DP, MP)
CP = "cp"  # context-parallel axis: the sequence split over it (a mesh has it only when cp > 1: ``Layout``)
PP = "pp"  # pipeline axis: consecutive layer chunks over it (``parallel.pipeline``); outermost when present
# A layout with pp > 1 has the mesh (pp, dp, mp); without, (dp, mp) as always (``Layout.shape``);
# cp > 1 adds CP between DP and MP: (pp, dp, cp, mp), each axis present only when its size > 1.
PIPELINE_MESH_AXES = (PP, DP, MP)
