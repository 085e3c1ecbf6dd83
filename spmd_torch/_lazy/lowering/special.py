"""Lowerings: special functions (gamma family, Bessel, error functions, orthogonal polynomials).

Most are ``jax.scipy.special`` behind the ``floating`` adapter (integers compute in the default
float, bf16/f16 in float32 rounded once); a wrapper exists only where ATen's value at a pole,
a NaN or outside the domain differs from SciPy's. The orthogonal polynomials run ATen's own
recurrences, with the degree ``n`` a tensor, up to the largest degree present; trigamma and
zeta at negative arguments follow ATen's algorithms (jax.scipy's are wrong there). Bessel J, Y
and K of orders 0 and 1 and Airy Ai, which jax.scipy lacks, and erfcx (jax.scipy's underflows)
are textbook series and expansions in float64.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import jax.scipy.special as jsp
import numpy as np
import torch
from jax import lax

from ._helpers import floating
from .registry import lowers, register_table

aten = torch.ops.aten


def _mvlgamma(x, p):
    """log of the multivariate gamma function of dimension p."""
    terms = x[..., None] - jnp.arange(p, dtype=x.dtype) / 2
    return lax.lgamma(terms).sum(-1) + p * (p - 1) / 4 * math.log(math.pi)


def _entr(x):
    """-x log x: 0 at 0, -inf below 0, NaN stays NaN."""
    return jnp.where(x > 0, -x * jnp.log(jnp.where(x > 0, x, 1)), jnp.where(x == 0, 0, -jnp.inf))


def _xlog1py(x, y):
    """x * log1p(y), 0 where x is 0 unless y is NaN (jax.scipy's gives 0 there too)."""
    return jnp.where(jnp.isnan(y), y, jnp.where(x == 0, 0, x * jnp.log1p(y)))


def _sinc(x):
    return jnp.sinc(x)


def _zeta(x, q):
    """Hurwitz zeta as Cephes (and ATen) define it: inf at x = 1 and at integer q <= 0, NaN for
    x < 1 and for q < 0 with x not an integer. Below q = 1 the terms (q + k)^-x are added one by
    one until q + k reaches 1 (Cephes sums directly too; jax.scipy's fixed series loses accuracy
    at negative q), then jax.scipy's series takes the rest. The terms have both signs and cancel:
    they are summed in float64, as ATen's CPU kernel computes (its accumulate type)."""
    x, q = jnp.broadcast_arrays(x, q)
    pole = (x == 1) | ((q <= 0) & (q == jnp.floor(q)))
    undefined = (x < 1) | ((q < 0) & (x != jnp.floor(x)))
    steps = jnp.where(pole | undefined, 0, jnp.fmax(jnp.ceil(1 - q), 0))  # fmax: NaN q adds none

    wide_x, wide_q = x.astype(jnp.float64), q.astype(jnp.float64)

    def add_term(carry):
        k, total = carry
        return k + 1, total + jnp.where(k < steps, (wide_q + k) ** -wide_x, 0)

    start = (jnp.zeros((), jnp.float64), jnp.zeros_like(wide_q))
    _, head = lax.while_loop(lambda c: c[0] < jnp.max(steps, initial=0), add_term, start)
    value = (head + jsp.zeta(x, q + steps)).astype(q.dtype)
    return jnp.where(pole, jnp.inf, jnp.where(undefined, jnp.nan, value))


def _digamma(x):
    """jax.scipy's digamma, but -inf at +0 and inf at -0 as ATen (jax.scipy gives NaN)."""
    return jnp.where(x == 0, jnp.copysign(jnp.inf, -x), jsp.digamma(x))


def _trigamma(x):
    """ATen's trigamma: reflection below 0.5, six recurrence steps, then the asymptotic series
    (jax.scipy's polygamma(1, x) is wrong for x < 0)."""
    reflected = x < 0.5
    sin_pi_x = jnp.sin(math.pi * x)
    result = jnp.where(reflected, -(math.pi**2) / (sin_pi_x * sin_pi_x), 0)
    x = jnp.where(reflected, 1 - x, x)
    for _ in range(6):
        result = result + 1 / (x * x)
        x = x + 1
    ixx = 1 / (x * x)
    result = result + (1 + 1 / (2 * x) + ixx * (1 / 6 - ixx * (1 / 30 - ixx / 42))) / x
    return jnp.where(reflected, -result, result)


def _polygamma(n, x):
    """ATen's definition: digamma, trigamma, else (-1)^(n+1) n! zeta(n + 1, x)."""
    if n == 0:
        return _digamma(x)
    if n == 1:
        return _trigamma(x)
    return (-1) ** (n + 1) * math.factorial(n) * _zeta(jnp.asarray(n + 1, x.dtype), x)


def _spherical_bessel_j0(x):
    """sin(x)/x, 1 at 0; ATen's series below |x| = 0.5 agrees to the last bit."""
    return jnp.where(x == 0, 1, jnp.sin(x) / jnp.where(x == 0, 1, x))


_ERFCX_DIRECT_BELOW = 25.0  # exp(x^2) stays finite and erfc(x) normal in float64 up to here


def _erfcx(x):
    """exp(x^2) erfc(x) in float64 below 25 (jax.scipy's, in the input dtype, underflows to 0
    from x = 9.2 in float32), above it the asymptotic series 1/(x sqrt(pi)) sum_k
    (-1)^k (2k-1)!! / (2x^2)^k, whose seventh term is below 1e-16 there."""
    wide = x.astype(jnp.float64)
    direct = wide < _ERFCX_DIRECT_BELOW
    near = jnp.where(direct, wide, 0)
    far = jnp.where(direct, _ERFCX_DIRECT_BELOW, wide)
    term = series = 1.0
    for k in range(1, 7):
        term = -term * (2 * k - 1) / (2 * far * far)
        series = series + term
    value = jnp.where(
        direct, jnp.exp(near * near) * lax.erfc(near), series / (far * math.sqrt(math.pi))
    )
    return value.astype(x.dtype)


# --- Bessel J, Y and K of orders 0 and 1, which jax.scipy lacks: textbook formulas in float64 --


_HANKEL_FROM = 20.0  # J/Y: power series below (float64 keeps its cancellation under 1e-9)
_SERIES_TERMS = 48  # (x^2/4)^k / (k!)^2 is below 1e-23 of the sum's largest term by then at x = 20


def _bessel_series(x, n, sign):
    """(x/2)^n sum_k sign^k (x^2/4)^k / (k! (n+k)!) (J_n for sign -1, I_n for +1) and the same
    sum weighted by psi(k+1) + psi(n+k+1) (Abramowitz & Stegun 9.1.11, 9.6.11)."""
    z = sign * x * x / 4
    term = (x / 2) ** n / math.factorial(n)
    psi_k, psi_nk = -np.euler_gamma, -np.euler_gamma + sum(1 / j for j in range(1, n + 1))
    plain, weighted = term, term * (psi_k + psi_nk)
    for k in range(1, _SERIES_TERMS):
        term = term * z / (k * (n + k))
        psi_k, psi_nk = psi_k + 1 / k, psi_nk + 1 / (n + k)
        plain, weighted = plain + term, weighted + term * (psi_k + psi_nk)
    return plain, weighted


def _bessel_jy_series(x, n):
    """J_n and Y_n (n = 0, 1) for 0 < x < 20 (A&S 9.1.10, 9.1.11)."""
    j, weighted = _bessel_series(x, n, -1)
    y = 2 / math.pi * jnp.log(x / 2) * j - weighted / math.pi
    return j, y - 2 / (math.pi * x) if n == 1 else y


def _bessel_jy_hankel(x, n):
    """J_n and Y_n (n = 0, 1) for x >= 20: Hankel's asymptotic expansion (A&S 9.2.5-9.2.10), the
    phase x - (n/2 + 1/4) pi taken through cos x and sin x so that it stays exact."""
    mu, p, q, a = 4 * n * n, 1.0, 0.0, 1.0
    for k in range(1, 13):  # a_k(n) / x^k alternate between Q (k odd) and P (k even)
        a = a * (mu - (2 * k - 1) ** 2) / (8 * k)
        sign = -1 if k % 4 in (2, 3) else 1
        if k % 2:
            q = q + sign * a / x**k
        else:
            p = p + sign * a / x**k
    phase = (n / 2 + 1 / 4) * math.pi
    cos_chi = jnp.cos(x) * math.cos(phase) + jnp.sin(x) * math.sin(phase)
    sin_chi = jnp.sin(x) * math.cos(phase) - jnp.cos(x) * math.sin(phase)
    scale = jnp.sqrt(2 / (math.pi * x))
    return scale * (p * cos_chi - q * sin_chi), scale * (p * sin_chi + q * cos_chi)


def _bessel_jy(x, n):
    """J_n and Y_n of |x| in float64 (J_1 odd; Y is NaN below 0 and -inf at 0, as in ATen)."""
    ax = jnp.abs(x.astype(jnp.float64))
    small = ax < _HANKEL_FROM
    j_small, y_small = _bessel_jy_series(jnp.where(small & (ax > 0), ax, 1), n)
    j_large, y_large = _bessel_jy_hankel(jnp.where(small, _HANKEL_FROM, ax), n)
    j, y = jnp.where(small, j_small, j_large), jnp.where(small, y_small, y_large)
    j = jnp.where(ax == 0, 1 - n, j)
    y = jnp.where(x < 0, jnp.nan, jnp.where(x == 0, -jnp.inf, y))
    return (jnp.sign(x) * j if n else j).astype(x.dtype), y.astype(x.dtype)


_K_SERIES_BELOW = 1.0
_K_STEP, _K_POINTS = 0.25, 27  # trapezoid on u in [0, 6.5], where e^-u^2 has fallen below 1e-18


def _bessel_k(x, n, scaled):
    """K_n (n = 0, 1), times e^x if ``scaled``, in float64: A&S 9.6.11's series below 1, else
    e^x K_n(x) = int_0^inf exp(-x (cosh t - 1)) cosh(n t) dt with u = sqrt(2x) sinh(t/2), i.e.
    int_0^inf e^-u^2 (1 + u^2/x)^n 2 / sqrt(2x + u^2) du: a Gaussian whatever x, which the
    trapezoid rule integrates to float64 precision. inf at 0, NaN below 0, as in ATen."""
    wide = x.astype(jnp.float64)
    small = wide < _K_SERIES_BELOW
    xs = jnp.where(small & (wide > 0), wide, 1)
    i, weighted = _bessel_series(xs, n, 1)
    k_small = (-1) ** (n + 1) * jnp.log(xs / 2) * i + (-1) ** n * weighted / 2 + n / xs
    u = _K_STEP * np.arange(_K_POINTS)
    weights = np.where(u == 0, _K_STEP / 2, _K_STEP) * 2 * np.exp(-u * u)
    xl = jnp.where(small, 2, wide)[..., None]
    scaled_large = jnp.sum(weights * (1 + u * u / xl) ** n / jnp.sqrt(2 * xl + u * u), axis=-1)
    if scaled:
        value = jnp.where(small, k_small * jnp.exp(xs), scaled_large)
    else:
        value = jnp.where(small, k_small, scaled_large * jnp.exp(-xl[..., 0]))
    return jnp.where(wide == 0, jnp.inf, jnp.where(wide < 0, jnp.nan, value)).astype(x.dtype)


_AIRY_SERIES_WITHIN = (-8.0, 5.0)  # Maclaurin series in here: float64 cancellation below 1e-9
_AIRY_AI0, _AIRY_AI0_SLOPE = 3 ** (-2 / 3) / math.gamma(2 / 3), -(3 ** (-1 / 3)) / math.gamma(1 / 3)
# u_k = Gamma(3k + 1/2) / (54^k k! Gamma(k + 1/2)): the coefficients of Ai's asymptotic series
_AIRY_U = [
    math.gamma(3 * k + 0.5) / (54**k * math.factorial(k) * math.gamma(k + 0.5)) for k in range(12)
]


def _airy_ai(x):
    """Airy Ai in float64 (A&S 10.4.2-10.4.3 and 10.4.59-10.4.60): the Maclaurin series between
    -8 and 5, asymptotic expansions in zeta = 2/3 |x|^(3/2) beyond; NaN at +-inf as in ATen."""
    wide = x.astype(jnp.float64)
    low, high = _AIRY_SERIES_WITHIN
    inside = (wide >= low) & (wide <= high)
    t = jnp.where(inside, wide, 0)
    f = term_f = 1.0
    g = term_g = t
    for k in range(1, 30):
        term_f = term_f * t**3 / ((3 * k - 1) * (3 * k))
        term_g = term_g * t**3 / ((3 * k) * (3 * k + 1))
        f, g = f + term_f, g + term_g
    series = _AIRY_AI0 * f + _AIRY_AI0_SLOPE * g
    r = jnp.abs(jnp.where(inside, high, wide))
    zeta = 2 / 3 * r**1.5
    decaying = sum((-1) ** k * u / zeta**k for k, u in enumerate(_AIRY_U))
    right = jnp.exp(-zeta) / (2 * math.sqrt(math.pi) * r**0.25) * decaying
    even = sum((-1) ** k * u / zeta ** (2 * k) for k, u in enumerate(_AIRY_U[::2]))
    odd = sum((-1) ** k * u / zeta ** (2 * k + 1) for k, u in enumerate(_AIRY_U[1::2]))
    phase = zeta + math.pi / 4
    left = (jnp.sin(phase) * even - jnp.cos(phase) * odd) / (math.sqrt(math.pi) * r**0.25)
    value = jnp.where(inside, series, jnp.where(wide > 0, right, left))
    return jnp.where(jnp.isinf(wide), jnp.nan, value).astype(x.dtype)


register_table(
    {
        aten.lgamma.default: lax.lgamma,
        aten.digamma.default: _digamma,
        aten.erfc.default: lax.erfc,
        aten.special_erfcx.default: _erfcx,
        aten.special_airy_ai.default: _airy_ai,
        (aten.i0.default, aten.special_i0.default): jsp.i0,
        aten.special_i0e.default: jsp.i0e,
        aten.special_i1.default: jsp.i1,
        aten.special_i1e.default: jsp.i1e,
        aten.special_modified_bessel_i0.default: jsp.i0,
        aten.special_modified_bessel_i1.default: jsp.i1,
        aten.special_ndtr.default: jsp.ndtr,
        aten.special_ndtri.default: jsp.ndtri,
        aten.special_log_ndtr.default: jsp.log_ndtr,
        aten.special_entr.default: _entr,
        aten.sinc.default: _sinc,
        aten.special_spherical_bessel_j0.default: _spherical_bessel_j0,
        aten.special_bessel_j0.default: lambda x: _bessel_jy(x, 0)[0],
        aten.special_bessel_j1.default: lambda x: _bessel_jy(x, 1)[0],
        aten.special_bessel_y0.default: lambda x: _bessel_jy(x, 0)[1],
        aten.special_bessel_y1.default: lambda x: _bessel_jy(x, 1)[1],
        aten.special_modified_bessel_k0.default: lambda x: _bessel_k(x, 0, scaled=False),
        aten.special_modified_bessel_k1.default: lambda x: _bessel_k(x, 1, scaled=False),
        aten.special_scaled_modified_bessel_k0.default: lambda x: _bessel_k(x, 0, scaled=True),
        aten.special_scaled_modified_bessel_k1.default: lambda x: _bessel_k(x, 1, scaled=True),
        (
            aten.special_xlog1py.default,
            aten.special_xlog1py.self_scalar,
            aten.special_xlog1py.other_scalar,
        ): _xlog1py,
        (
            aten.special_zeta.default,
            aten.special_zeta.self_scalar,
            aten.special_zeta.other_scalar,
        ): _zeta,
    },
    adapt=floating,
)


_FLOAT_POLYGAMMA = floating(lambda x, *, n: _polygamma(n, x))
_FLOAT_MVLGAMMA = floating(lambda x, *, p: _mvlgamma(x, p))


@lowers(aten.polygamma.default)
def _polygamma_lowering(n, x):
    return _FLOAT_POLYGAMMA(x, n=n)


@lowers(aten.mvlgamma.default)
def _mvlgamma_lowering(x, p):
    return _FLOAT_MVLGAMMA(x, p=p)


# --- orthogonal polynomials: ATen's recurrences, up to the largest degree present -----------


def _recurrence(x, n, p0, p1, step):
    """P_n(x) from P_0 = p0, P_1 = p1 and P_{k+1} = step(k, x, P_{k-1}, P_k), per element; the
    loop runs to max(n), each element keeping its value once k reaches its own n."""

    def body(carry):
        k, p, q = carry
        r = step(k, x, p, q)
        return k + 1, jnp.where(k < n, q, p), jnp.where(k < n, r, q)

    _, _, q = lax.while_loop(lambda c: c[0] < jnp.max(n, initial=1), body, (1, p0, p1))
    return jnp.where(n == 0, p0, q)


def _polynomial(p1_of, step, special=None):
    """A polynomial P_n(x) with integer n (ATen truncates it), 0 for n < 0; ``special`` gives
    (where, value) for ATen's closed forms (|x| = 1, cos/sin forms for large n)."""

    def fn(x, n):
        x, n = jnp.broadcast_arrays(x, n)
        k = jnp.trunc(n).astype(jnp.int64)
        value = _recurrence(x, k, jnp.ones_like(x), p1_of(x), step)
        if special is not None:
            for where, closed in special(x, k):
                value = jnp.where(where, closed, value)
        return jnp.where(k < 0, 0, value)

    return fn


def _chebyshev_step(k, x, p, q):
    return 2 * x * q - p


def _shifted(fn):
    """The shifted polynomial on [0, 1]: the polynomial at 2x - 1."""
    return lambda x, n: fn(2 * x - 1, n)


def _chebyshev_t_special(x, n):
    big = (n > 6) & (jnp.abs(x) < 1)
    one = jnp.where((x > 0) | (n % 2 == 0), 1, -1)
    return [(big, jnp.cos(n * jnp.arccos(x))), (jnp.abs(x) == 1, one)]


def _chebyshev_u_special(x, n):
    theta = jnp.arccos(x)
    big = (n > 8) & (jnp.abs(x) < 1) & (jnp.sin(theta) != 0)
    closed = jnp.sin((n + 1) * theta) / jnp.where(jnp.sin(theta) != 0, jnp.sin(theta), 1)
    one = jnp.where((x > 0) | (n % 2 == 0), n + 1, -(n + 1))
    return [(big, closed), (jnp.abs(x) == 1, one)]


def _chebyshev_v_special(x, n):
    theta = jnp.arccos(x)
    half = jnp.sin(theta / 2)
    big = (n > 8) & (jnp.abs(x) < 1) & (half != 1)
    closed = jnp.cos((n + 0.5) * theta) / jnp.cos(theta / 2)
    at_one = jnp.where(x > 0, 1, jnp.where(n % 2 == 0, n + n + 1, -(n + n + 1)))
    return [(big, closed), (jnp.abs(x) == 1, at_one)]


def _chebyshev_w_special(x, n):
    theta = jnp.arccos(x)
    big = (n > 8) & (jnp.abs(x) < 1) & (jnp.cos(theta / 2) != 1)
    closed = jnp.sin((n + 0.5) * theta) / jnp.sin(theta / 2)
    at_one = jnp.where(x > 0, n + n + 1, jnp.where(n % 2 == 0, 1, -1))
    return [(big, closed), (jnp.abs(x) == 1, at_one)]


def _legendre_step(k, x, p, q):
    return ((2 * k + 1) * x * q - k * p) / (k + 1)


def _laguerre_step(k, x, p, q):
    return ((2 * k + 1 - x) * q - k * p) / (k + 1)


def _hermite_h_step(k, x, p, q):
    return 2 * x * q - 2 * k * p


def _hermite_he_step(k, x, p, q):
    return x * q - k * p


def _legendre_special(x, n):
    return [(jnp.abs(x) == 1, jnp.where((x > 0) | (n % 2 == 0), 1, -1))]


def _laguerre_special(x, n):
    return [(x == 0, jnp.ones_like(x))]


_CHEBYSHEV_T = _polynomial(lambda x: x, _chebyshev_step, _chebyshev_t_special)
_CHEBYSHEV_U = _polynomial(lambda x: 2 * x, _chebyshev_step, _chebyshev_u_special)
_CHEBYSHEV_V = _polynomial(lambda x: 2 * x - 1, _chebyshev_step, _chebyshev_v_special)
_CHEBYSHEV_W = _polynomial(lambda x: 2 * x + 1, _chebyshev_step, _chebyshev_w_special)

_POLYNOMIALS = {
    "chebyshev_polynomial_t": _CHEBYSHEV_T,
    "chebyshev_polynomial_u": _CHEBYSHEV_U,
    "chebyshev_polynomial_v": _CHEBYSHEV_V,
    "chebyshev_polynomial_w": _CHEBYSHEV_W,
    "shifted_chebyshev_polynomial_t": _shifted(_CHEBYSHEV_T),
    "shifted_chebyshev_polynomial_u": _shifted(_CHEBYSHEV_U),
    "shifted_chebyshev_polynomial_v": _shifted(_CHEBYSHEV_V),
    "shifted_chebyshev_polynomial_w": _shifted(_CHEBYSHEV_W),
    "legendre_polynomial_p": _polynomial(lambda x: x, _legendre_step, _legendre_special),
    "laguerre_polynomial_l": _polynomial(lambda x: 1 - x, _laguerre_step, _laguerre_special),
    "hermite_polynomial_h": _polynomial(lambda x: 2 * x, _hermite_h_step),
    "hermite_polynomial_he": _polynomial(lambda x: x, _hermite_he_step),
}
register_table(
    {
        tuple(
            getattr(getattr(aten, f"special_{name}"), o)
            for o in ("default", "x_scalar", "n_scalar")
        ): fn
        for name, fn in _POLYNOMIALS.items()
    },
    adapt=floating,
)
