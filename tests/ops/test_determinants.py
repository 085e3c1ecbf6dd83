"""Determinants' gradients on matrices that are not symmetric, against eager CPU: ATen's backward
reads the LU factors the forward kept, and for a real matrix those are its transpose's (a
gradient taken from the matrix's own factors comes out transposed)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_matches_eager


def _logabsdet(a: torch.Tensor) -> torch.Tensor:
    return torch.linalg.slogdet(a)[1]


@pytest.mark.parametrize(
    "determinant",
    [torch.linalg.det, torch.det, _logabsdet, lambda a: torch.logdet(a @ a.mT)],
    ids=["linalg.det", "det", "slogdet", "logdet"],
)
@pytest.mark.parametrize("batch", [(), (3,)], ids=["one", "batched"])
def test_gradient_of_a_nonsymmetric_matrix_matches_eager(determinant, batch):
    torch.manual_seed(0)
    a = torch.randn(*batch, 5, 5)
    assert not torch.allclose(a, a.mT)
    assert_matches_eager(determinant, a, grad=True)


def test_gradient_of_a_transposed_view_matches_eager():
    torch.manual_seed(1)
    a = torch.randn(4, 4)
    assert_matches_eager(lambda m: torch.linalg.det(m.mT * 2), a, grad=True)


def test_complex_determinants_gradient_matches_eager():
    """A complex matrix's factors are its own (ATen transposes only real ones)."""
    torch.manual_seed(2)
    real, imag = torch.randn(4, 4), torch.randn(4, 4)

    def det_parts(re, im):
        return torch.view_as_real(torch.linalg.det(torch.complex(re, im)))

    assert_matches_eager(det_parts, real, imag, grad=True)
