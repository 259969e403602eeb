// Rotary position embedding on interleaved pairs, in place on [batch, seq, heads, head_dim].
// direction = +1 rotates forward, -1 applies the transpose (the backward). x16, when not null,
// gets the result's bf16 rounding (for the attention kernels and GEMMs that read it).

extern "C" __global__ void rope_rotate(float* x, bf16_bits* x16, const float* cos_table,
                                       const float* sin_table, i64 pairs, int seq, int heads,
                                       int head_dim, int pos_offset, float direction) {
    int half = head_dim / 2;
    TITAN_FOR_EACH(p, pairs) {
        int i = (int)(p % half);
        i64 token = p / half / heads;
        i64 pos = pos_offset + token % seq;
        float c = cos_table[pos * half + i];
        float s = direction * sin_table[pos * half + i];
        float x0 = x[2 * p], x1 = x[2 * p + 1];
        float y0 = x0 * c - x1 * s, y1 = x0 * s + x1 * c;
        x[2 * p] = y0;
        x[2 * p + 1] = y1;
        if (x16) ((u32*)x16)[p] = bf16_pair(y0, y1);
    }
}
