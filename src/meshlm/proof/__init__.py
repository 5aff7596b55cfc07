"""The proof: sharded == unsharded, parameter by parameter, with negative controls."""

from meshlm.proof.prover import Problem, Report, format_report, model_problem, verify

__all__ = ["Problem", "Report", "format_report", "model_problem", "verify"]
