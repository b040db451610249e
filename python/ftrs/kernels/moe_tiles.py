# mypy: allow-untyped-defs
# (Triton reads the annotations of @triton.jit functions itself: its kernels carry none but tl.constexpr.)
"""The weight tiles of the fused MoE kernels (`kernels/moe.py`): a (BK, BN) tile of a slot's
matrix transposed, dequantized in-kernel from its encoding (`QUANT`, the codes of
`moe._QUANT_CODE`; the layouts are `kernels/moe.py`'s module doc) to the activations' dtype."""

from __future__ import annotations

from ftrs.kernels._triton import triton_importable

if triton_importable():
    import triton
    import triton.language as tl

    from ftrs.kernels._triton import round_to

    @triton.jit
    def _fp8_e4m3(b):
        """uint8 bits of float8_e4m3fn -> fp32, exactly (through the fp32 bits)."""
        b = b.to(tl.uint32)
        e = (b >> 3) & 15
        m = b & 7
        normal = ((b >> 7) << 31) | ((e + 120) << 23) | (m << 20)
        sub = m.to(tl.float32) * 0.001953125  # 2^-9: e == 0
        sub = tl.where((b >> 7) == 1, -sub, sub)
        return tl.where(e == 0, sub, normal.to(tl.float32, bitcast=True))

    @triton.jit
    def _iq4_level(c):
        """IQ4's level of nibble `c` (int32): -127, -104, -83, -65, -49, -35, -22, -10, 1, 13,
        25, 38, 53, 69, 89, 113, by a tree of selects (no table reads)."""
        a = tl.where(c % 2 == 0, tl.where(c < 4, tl.where(c == 0, -127, -83),
                                          tl.where(c == 4, -49, -22)),
                     tl.where(c < 4, tl.where(c == 1, -104, -65), tl.where(c == 5, -35, -10)))
        b = tl.where(c % 2 == 0, tl.where(c < 12, tl.where(c == 8, 1, 25),
                                          tl.where(c == 12, 53, 89)),
                     tl.where(c < 12, tl.where(c == 9, 13, 38), tl.where(c == 13, 69, 113)))
        return tl.where(c < 8, a, b).to(tl.float32)

    @triton.jit
    def _e2m1_x2(c):
        """An e2m1 nibble (int32) -> its value doubled: 0, 1, 2, 3, 4, 6, 8, 12, sign in bit 3
        (ggml's table, which MXFP4's and NVFP4's halved scales undo)."""
        ex = (c >> 1) & 3
        mb = c & 1
        mag = tl.where(ex == 0, mb, (2 + mb) << tl.where(ex == 0, 0, ex - 1))
        return tl.where(c >= 8, -mag, mag).to(tl.float32)

    @triton.jit
    def _ue4m3_half(s):
        """NVFP4's unsigned e4m3 scale byte (int32) -> half its value (0x7F reads as 0, bit 7
        ignored), as `quant.dequant.ue4m3_half`."""
        e = (s >> 3) & 15
        m = s & 7
        normal = (((e + 119) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        v = tl.where(e == 0, m.to(tl.float32) * 0.0009765625, normal)  # 2^-10
        return tl.where(s == 0x7F, 0.0, v)

    @triton.jit
    def _k_scale_min(blk, j, mask):
        """Q4_K/Q5_K: the 6-bit scale and min of sub-block `j` (per column of the tile), packed
        in the 12 bytes after the super-block's d and dmin (`blk` points at its start)."""
        lo = (j < 4)[:, None]
        sa = tl.load(blk + (4 + j)[:, None], mask=mask, other=0).to(tl.int32)
        sb4 = tl.load(blk + (8 + j)[:, None], mask=mask, other=0).to(tl.int32)
        sc4 = tl.load(blk + (4 + tl.where(j < 4, 0, j - 4))[:, None], mask=mask,
                      other=0).to(tl.int32)
        sc = tl.where(lo, sa & 63, (sb4 & 15) | ((sc4 >> 6) << 4)).to(tl.float32)
        mn = tl.where(lo, sb4 & 63, (sb4 >> 4) | ((sa >> 6) << 4)).to(tl.float32)
        return sc, mn

    @triton.jit
    def _low_quants(w_ptr, ws_ptr, slot, n, k, n_rows, n_cols, stride_s, stride_r, sc_stride_s,
                    sc_stride_r, QUANT: tl.constexpr, DT: tl.constexpr):
        """The tiles of the types a second kernel switch keeps `_w_tile` short for: Q4_0,
        Q4_1, Q5_0, Q2_K, Q3_K, Q5_K, NVFP4 (layouts: `kernels/moe.py`'s module doc)."""
        mask = (n < n_rows)[None, :] & (k < n_cols)[:, None]
        base = w_ptr + slot * stride_s + n[None, :] * stride_r
        sbase = ws_ptr + slot * sc_stride_s + n[None, :] * sc_stride_r
        if QUANT <= 11:  # Q4_0 (9), Q4_1 (10), Q5_0 (11): 32-value blocks
            blk = k // 32
            j = k % 32
            half = (j < 16)[:, None]
            if QUANT == 9:  # 18 bytes: fp16 d, 16 bytes of nibbles: d*(q - 8)
                byte = tl.load(base + (blk * 18 + 2 + j % 16)[:, None], mask=mask,
                               other=0).to(tl.int32)
                q = (tl.where(half, byte & 15, byte >> 4) - 8).to(tl.float32)
                d = tl.load(sbase + (blk * 9)[:, None], mask=mask, other=0.0).to(tl.float32)
                return round_to(d * q, DT)
            elif QUANT == 10:  # 20 bytes: fp16 d and m, 16 bytes of nibbles: d*q + m
                byte = tl.load(base + (blk * 20 + 4 + j % 16)[:, None], mask=mask,
                               other=0).to(tl.int32)
                q = tl.where(half, byte & 15, byte >> 4).to(tl.float32)
                hb = sbase + (blk * 10)[:, None]
                d = tl.load(hb, mask=mask, other=0.0).to(tl.float32)
                m = tl.load(hb + 1, mask=mask, other=0.0).to(tl.float32)
                return round_to(d * q + m, DT)
            else:  # Q5_0, 22 bytes: fp16 d, 4 bytes of fifth bits, nibbles: d*(q - 16)
                bb = base + (blk * 22)[:, None]
                byte = tl.load(bb + (6 + j % 16)[:, None], mask=mask, other=0).to(tl.int32)
                hb = tl.load(bb + (2 + j // 8)[:, None], mask=mask, other=0).to(tl.int32)
                q = tl.where(half, byte & 15, byte >> 4) | (((hb >> (j % 8)[:, None]) & 1) << 4)
                d = tl.load(sbase + (blk * 11)[:, None], mask=mask, other=0.0).to(tl.float32)
                return round_to(d * (q - 16).to(tl.float32), DT)
        elif QUANT <= 13:  # Q2_K (12, 84 bytes), Q3_K (13, 110): 2-bit quants
            sb = k // 256
            i = k % 256
            g = i // 16  # 16-value group: one scale
            # 2-bit quant: byte 32*(i//128) + i%32 of the quants, bits 2*((i%128)//32)
            qoff = 32 * (i // 128) + i % 32
            sh = (2 * ((i % 128) // 32))[:, None]
            if QUANT == 12:  # 16 bytes of scale/min nibbles, 64 of quants, fp16 d and dmin
                bb = base + (sb * 84)[:, None]
                q = ((tl.load(bb + (16 + qoff)[:, None], mask=mask, other=0).to(tl.int32) >> sh)
                     & 3).to(tl.float32)
                s = tl.load(bb + g[:, None], mask=mask, other=0).to(tl.int32)
                hb = sbase + (sb * 42)[:, None]
                d = tl.load(hb + 40, mask=mask, other=0.0).to(tl.float32)
                dmin = tl.load(hb + 41, mask=mask, other=0.0).to(tl.float32)
                return round_to((d * (s & 15).to(tl.float32)) * q
                                - dmin * (s >> 4).to(tl.float32), DT)
            else:  # 32 bytes of high-bit masks, 64 of quants, 12 of 6-bit scales, fp16 d
                bb = base + (sb * 110)[:, None]
                ql = (tl.load(bb + (32 + qoff)[:, None], mask=mask, other=0).to(tl.int32)
                      >> sh) & 3
                hm = tl.load(bb + (i % 32)[:, None], mask=mask, other=0).to(tl.int32)
                q = ql - ((((hm >> (i // 32)[:, None]) & 1) ^ 1) << 2)
                lo = tl.load(bb + (96 + g % 8)[:, None], mask=mask, other=0).to(tl.int32)
                lo = tl.where((g < 8)[:, None], lo & 15, lo >> 4)
                hi = tl.load(bb + (104 + g % 4)[:, None], mask=mask, other=0).to(tl.int32)
                hi = (hi >> (2 * (g // 4))[:, None]) & 3
                sc = ((lo | (hi << 4)) - 32).to(tl.float32)
                d = tl.load(sbase + (sb * 55 + 54)[:, None], mask=mask, other=0.0).to(tl.float32)
                return round_to((d * sc) * q.to(tl.float32), DT)
        elif QUANT == 14:  # Q5_K: 176 bytes, Q4_K's header, 32 bytes of fifth bits, nibbles
            sb = k // 256
            j = (k % 256) // 32  # sub-block
            blk = base + (sb * 176)[:, None]
            byte = tl.load(blk + (48 + 32 * (j // 2) + k % 32)[:, None], mask=mask,
                           other=0).to(tl.int32)
            hb = tl.load(blk + (16 + k % 32)[:, None], mask=mask, other=0).to(tl.int32)
            q = (tl.where((j % 2 == 0)[:, None], byte & 15, byte >> 4)
                 | (((hb >> j[:, None]) & 1) << 4)).to(tl.float32)
            sc, mn = _k_scale_min(blk, j, mask)
            hbase = sbase + (sb * 88)[:, None]
            d = tl.load(hbase, mask=mask, other=0.0).to(tl.float32)
            dmin = tl.load(hbase + 1, mask=mask, other=0.0).to(tl.float32)
            return round_to((d * sc) * q - dmin * mn, DT)
        else:  # NVFP4: 36-byte blocks of 64 values; `ws_ptr`: the matrix's fp32 tensor scale
            blk = k // 64
            s = (k % 64) // 16  # sub-block: scale byte s, then 8 bytes of nibbles
            t = k % 16
            bb = base + (blk * 36)[:, None]
            byte = tl.load(bb + (4 + 8 * s + t % 8)[:, None], mask=mask, other=0).to(tl.int32)
            lvl = _e2m1_x2(tl.where((t < 8)[:, None], byte & 15, byte >> 4))
            d = _ue4m3_half(tl.load(bb + s[:, None], mask=mask, other=0).to(tl.int32))
            ts = tl.load(sbase + (k * 0)[:, None], mask=mask, other=0.0)
            return round_to((d * lvl) * ts, DT)

    @triton.jit
    def _byte(bb, off, mask):
        return tl.load(bb + off, mask=mask, other=0).to(tl.int32)

    @triton.jit
    def _sign7(idx, j):
        """-1 or 1: bit `j` (0..7) of the byte a 7-bit sign index stands for (its seven bits and
        an eighth making the count of ones even)."""
        p = idx ^ (idx >> 4)
        p = p ^ (p >> 2)
        p = (p ^ (p >> 1)) & 1
        bit = tl.where(j < 7, (idx >> j) & 1, p)
        return tl.where(bit == 0, 1.0, -1.0)

    @triton.jit
    def _iq_tile(w_ptr, ws_ptr, grid_ptr, slot, n, k, n_rows, n_cols, stride_s, stride_r,
                 sc_stride_s, sc_stride_r, QUANT: tl.constexpr, DT: tl.constexpr):
        """The i-quants of three bits and less (codes 16..22; 256-value super-blocks, layouts in
        `quant/iquant.py`): each value's grid row entry read from `grid_ptr` (the type's fp32
        grid, 8 or 4 values a row), its sign, its scale, in the reference decoder's order."""
        mask = (n < n_rows)[None, :] & (k < n_cols)[:, None]
        base = w_ptr + slot * stride_s + n[None, :] * stride_r
        sbase = ws_ptr + slot * sc_stride_s + n[None, :] * sc_stride_r
        sb = k // 256
        i = (k % 256)[:, None]
        j8 = i % 8
        k8 = i // 8  # the 8-value group
        if QUANT == 16:  # IQ2_XXS, 66 bytes
            bb = base + (sb * 66)[:, None]
            ib = i // 32
            at = bb + 2 + 8 * ib
            aux = (_byte(at, 4, mask) | (_byte(at, 5, mask) << 8) | (_byte(at, 6, mask) << 16)
                   | (_byte(at, 7, mask).to(tl.uint32) << 24).to(tl.int32))
            idx = _byte(at, (i % 32) // 8, mask)
            sgn = _sign7((aux >> (7 * ((i % 32) // 8))) & 127, j8)
            d = tl.load(sbase + (sb * 33)[:, None], mask=mask, other=0.0).to(tl.float32)
            db = (d * (0.5 + ((aux >> 28) & 15).to(tl.float32))) * 0.25
            g = tl.load(grid_ptr + idx * 8 + j8, mask=mask, other=0.0)
            return round_to((db * g) * sgn, DT)
        elif QUANT == 17:  # IQ2_XS, 74 bytes: u16 (9-bit grid index, 7-bit sign index)
            bb = base + (sb * 74)[:, None]
            q = _byte(bb, 2 + 2 * k8, mask) | (_byte(bb, 3 + 2 * k8, mask) << 8)
            s = (_byte(bb, 66 + k8 // 4, mask) >> (4 * ((k8 // 2) % 2))) & 15
            d = tl.load(sbase + (sb * 37)[:, None], mask=mask, other=0.0).to(tl.float32)
            db = (d * (0.5 + s.to(tl.float32))) * 0.25
            g = tl.load(grid_ptr + (q & 511) * 8 + j8, mask=mask, other=0.0)
            return round_to((db * g) * _sign7(q >> 9, j8), DT)
        elif QUANT == 18:  # IQ2_S, 82 bytes: grid bytes, sign bytes, high bits, scales
            bb = base + (sb * 82)[:, None]
            idx = _byte(bb, 2 + k8, mask) | (((_byte(bb, 66 + k8 // 4, mask) >> (2 * (k8 % 4)))
                                              & 3) << 8)
            bit = (_byte(bb, 34 + k8, mask) >> j8) & 1
            s = (_byte(bb, 74 + k8 // 4, mask) >> (4 * ((k8 // 2) % 2))) & 15
            d = tl.load(sbase + (sb * 41)[:, None], mask=mask, other=0.0).to(tl.float32)
            db = (d * (0.5 + s.to(tl.float32))) * 0.25
            g = tl.load(grid_ptr + idx * 8 + j8, mask=mask, other=0.0)
            return round_to((db * g) * tl.where(bit == 0, 1.0, -1.0), DT)
        elif QUANT == 19:  # IQ3_XXS, 98 bytes: grid bytes (4 values each), u32 signs + scale
            bb = base + (sb * 98)[:, None]
            at = bb + 66 + 4 * (i // 32)
            aux = (_byte(at, 0, mask) | (_byte(at, 1, mask) << 8) | (_byte(at, 2, mask) << 16)
                   | (_byte(at, 3, mask).to(tl.uint32) << 24).to(tl.int32))
            idx = _byte(bb, 2 + i // 4, mask)
            sgn = _sign7((aux >> (7 * ((i % 32) // 8))) & 127, j8)
            d = tl.load(sbase + (sb * 49)[:, None], mask=mask, other=0.0).to(tl.float32)
            db = (d * (0.5 + ((aux >> 28) & 15).to(tl.float32))) * 0.5
            g = tl.load(grid_ptr + idx * 4 + i % 4, mask=mask, other=0.0)
            return round_to((db * g) * sgn, DT)
        elif QUANT == 20:  # IQ3_S, 110 bytes: grid bytes, ninth bits, sign bits, scales
            bb = base + (sb * 110)[:, None]
            k4 = i // 4
            idx = _byte(bb, 2 + k4, mask) | (((_byte(bb, 66 + k4 // 8, mask) >> (k4 % 8)) & 1)
                                             << 8)
            bit = (_byte(bb, 74 + i // 8, mask) >> j8) & 1
            s = (_byte(bb, 106 + i // 64, mask) >> (4 * ((i // 32) % 2))) & 15
            d = tl.load(sbase + (sb * 55)[:, None], mask=mask, other=0.0).to(tl.float32)
            db = d * (1 + 2 * s).to(tl.float32)
            g = tl.load(grid_ptr + idx * 4 + i % 4, mask=mask, other=0.0)
            return round_to((db * g) * tl.where(bit == 0, 1.0, -1.0), DT)
        elif QUANT == 21:  # IQ1_S, 50 bytes: grid bytes, u16 of high bits, scale, delta sign
            bb = base + (sb * 50)[:, None]
            ib = i // 32
            qh = _byte(bb, 34 + 2 * ib, mask) | (_byte(bb, 35 + 2 * ib, mask) << 8)
            idx = _byte(bb, 2 + k8, mask) | (((qh >> (3 * (k8 % 4))) & 7) << 8)
            d = tl.load(sbase + (sb * 25)[:, None], mask=mask, other=0.0).to(tl.float32)
            dl = d * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
            delta = tl.where((qh & 0x8000) == 0, 0.125, -0.125)
            g = tl.load(grid_ptr + idx * 8 + j8, mask=mask, other=0.0)
            return round_to(dl * (g + delta), DT)
        else:  # IQ1_M, 56 bytes: grid bytes, nibbles (high bits, delta sign), 4 u16 scales
            bb = base + (sb * 56)[:, None]
            nib = (_byte(bb, 32 + k8 // 2, mask) >> (4 * (k8 % 2))) & 15
            idx = _byte(bb, k8, mask) | ((nib & 7) << 8)
            sub = i // 16
            w = _byte(bb, 48 + 2 * (sub // 4), mask) | (_byte(bb, 49 + 2 * (sub // 4), mask) << 8)
            s = (w >> (3 * (sub % 4))) & 7
            bits = ((_byte(bb, 49, mask) >> 4) | (_byte(bb, 51, mask) & 0xF0)
                    | ((_byte(bb, 53, mask) & 0xF0) << 4) | ((_byte(bb, 55, mask) & 0xF0) << 8))
            d = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            dl = d * (2 * s + 1).to(tl.float32)
            delta = tl.where((nib & 8) == 0, 0.125, -0.125)
            g = tl.load(grid_ptr + idx * 8 + j8, mask=mask, other=0.0)
            return round_to(dl * (g + delta), DT)

    @triton.jit
    def _w_tile(w_ptr, ws_ptr, grid_ptr, slot, n, k, n_rows, n_cols, stride_s, stride_r,
                sc_stride_s, sc_stride_r, QUANT: tl.constexpr, DT: tl.constexpr,
                BR: tl.constexpr, BC: tl.constexpr):
        """(BK, BN) tile of W^T for W (n_rows, n_cols) of `slot`: rows `n`, columns `k`
        (`grid_ptr`: an i-quant's grid, codes 16..22)."""
        mask = (n < n_rows)[None, :] & (k < n_cols)[:, None]
        base = w_ptr + slot * stride_s + n[None, :] * stride_r
        sbase = ws_ptr + slot * sc_stride_s + n[None, :] * sc_stride_r
        if QUANT == 1:  # Q8_0: byte k//32*34 holds the fp16 scale, the int8 values follow it
            blk = k // 32
            q = tl.load(base + (blk * 34 + 2 + k % 32)[:, None], mask=mask, other=0)
            d = tl.load(sbase + (blk * 17)[:, None], mask=mask, other=0.0)
            return round_to(d.to(tl.float32) * q.to(tl.float32), DT)
        elif QUANT == 2:  # FP8_BLOCK: one byte per value, one fp32 scale per (BR, BC) tile
            bits = tl.load(base + k[:, None], mask=mask, other=0)
            sc = tl.load(ws_ptr + slot * sc_stride_s + (n // BR)[None, :] * sc_stride_r
                         + (k // BC)[:, None], mask=mask, other=0.0)
            return round_to(_fp8_e4m3(bits) * sc, DT)
        elif QUANT == 3:  # Q4_K: 144-byte super-blocks of 256 values (see the module doc)
            sb = k // 256
            j = (k % 256) // 32  # sub-block
            blk = base + (sb * 144)[:, None]
            byte = tl.load(blk + (16 + 32 * (j // 2) + k % 32)[:, None], mask=mask, other=0)
            q = tl.where((j % 2 == 0)[:, None], byte & 15, byte >> 4).to(tl.float32)
            sc, mn = _k_scale_min(blk, j, mask)
            hbase = sbase + (sb * 72)[:, None]
            d = tl.load(hbase, mask=mask, other=0.0).to(tl.float32)
            dmin = tl.load(hbase + 1, mask=mask, other=0.0).to(tl.float32)
            return round_to((d * sc) * q - dmin * mn, DT)
        elif QUANT == 4:  # Q5_1: 24-byte blocks of 32 values (see the module doc)
            blk = k // 32
            j = k % 32
            bb = base + (blk * 24)[:, None]
            byte = tl.load(bb + (8 + j % 16)[:, None], mask=mask, other=0).to(tl.int32)
            nib = tl.where((j < 16)[:, None], byte & 15, byte >> 4)
            hb = tl.load(bb + (4 + j // 8)[:, None], mask=mask, other=0).to(tl.int32)
            q = (nib | (((hb >> (j % 8)[:, None]) & 1) << 4)).to(tl.float32)
            hbase = sbase + (blk * 12)[:, None]
            d = tl.load(hbase, mask=mask, other=0.0).to(tl.float32)
            m = tl.load(hbase + 1, mask=mask, other=0.0).to(tl.float32)
            return round_to(d * q + m, DT)
        elif QUANT == 5:  # Q6_K: 210-byte super-blocks of 256 values (see the module doc)
            sb = k // 256
            i = k % 256
            h = i // 128  # half: 64 bytes of low nibbles, 32 of high bits, 8 scales each
            qu = (i % 128) // 32  # quarter: which nibble and which 2 high bits
            ln = i % 32
            bb = base + (sb * 210)[:, None]
            lb = tl.load(bb + (h * 64 + ln + (qu % 2) * 32)[:, None], mask=mask,
                         other=0).to(tl.int32)
            lo = tl.where((qu < 2)[:, None], lb & 15, lb >> 4)
            hb = tl.load(bb + (128 + h * 32 + ln)[:, None], mask=mask, other=0).to(tl.int32)
            q = ((lo | (((hb >> (2 * qu)[:, None]) & 3) << 4)) - 32).to(tl.float32)
            sc = tl.load(bb + (192 + i // 16)[:, None], mask=mask, other=0).to(tl.int32)
            sc = tl.where(sc >= 128, sc - 256, sc).to(tl.float32)  # int8
            d = tl.load(sbase + (sb * 105 + 104)[:, None], mask=mask, other=0.0).to(tl.float32)
            return round_to((d * sc) * q, DT)
        elif QUANT == 6:  # MXFP4: 17-byte blocks of 32 values (see the module doc)
            blk = k // 32
            j = k % 32
            bb = base + (blk * 17)[:, None]
            e = tl.load(bb, mask=mask, other=0).to(tl.int32)
            byte = tl.load(bb + (1 + j % 16)[:, None], mask=mask, other=0).to(tl.int32)
            # the e2m1 value doubled, times the halved e8m0 scale
            q = _e2m1_x2(tl.where((j < 16)[:, None], byte & 15, byte >> 4))
            dbits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
            return round_to(dbits.to(tl.float32, bitcast=True) * q, DT)
        elif QUANT == 7:  # IQ4_NL: 18-byte blocks of 32 values (see the module doc)
            blk = k // 32
            j = k % 32
            byte = tl.load(base + (blk * 18 + 2 + j % 16)[:, None], mask=mask, other=0).to(tl.int32)
            lvl = _iq4_level(tl.where((j < 16)[:, None], byte & 15, byte >> 4))
            d = tl.load(sbase + (blk * 9)[:, None], mask=mask, other=0.0).to(tl.float32)
            return round_to(d * lvl, DT)
        elif QUANT == 8:  # IQ4_XS: 136-byte super-blocks of 256 values (see the module doc)
            sb = k // 256
            s = (k % 256) // 32
            j = k % 32
            bb = base + (sb * 136)[:, None]
            byte = tl.load(bb + (8 + 16 * s + j % 16)[:, None], mask=mask, other=0).to(tl.int32)
            lvl = _iq4_level(tl.where((j < 16)[:, None], byte & 15, byte >> 4))
            lo = tl.load(bb + (4 + s // 2)[:, None], mask=mask, other=0).to(tl.int32)
            hw = tl.load(bb + 2, mask=mask, other=0).to(tl.int32) | (
                tl.load(bb + 3, mask=mask, other=0).to(tl.int32) << 8)
            ls = ((lo >> (4 * (s % 2))[:, None]) & 15) | (((hw >> (2 * s)[:, None]) & 3) << 4)
            d = tl.load(sbase + (sb * 68)[:, None], mask=mask, other=0.0).to(tl.float32)
            return round_to((d * (ls - 32).to(tl.float32)) * lvl, DT)
        elif QUANT >= 16:
            return _iq_tile(w_ptr, ws_ptr, grid_ptr, slot, n, k, n_rows, n_cols, stride_s,
                            stride_r, sc_stride_s, sc_stride_r, QUANT, DT)
        elif QUANT >= 9:
            return _low_quants(w_ptr, ws_ptr, slot, n, k, n_rows, n_cols, stride_s, stride_r,
                               sc_stride_s, sc_stride_r, QUANT, DT)
        else:
            return tl.load(base + k[:, None], mask=mask, other=0.0)
