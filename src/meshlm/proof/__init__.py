"""The proof: sharded == unsharded, parameter by parameter, with negative controls that must fail.

``prover`` runs the two computations and compares them; ``problem`` says what is proven; ``report``
holds the result and its table; ``controls`` the planted faults.
"""

from meshlm.proof.problem import Problem, model_problem
from meshlm.proof.prover import verify
from meshlm.proof.report import Report, format_report

__all__ = ["Problem", "Report", "format_report", "model_problem", "verify"]
