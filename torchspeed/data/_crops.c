/* A batch of crops rendered from JPEG bytes in one native call: decode the part each crop box needs
 * (libjpeg-turbo's TurboJPEG 3 API, DCT-scaled), resize the box to the output, flip it if asked, and
 * write it into its slot of the uint8 batch (CHW or HWC).
 *
 * Why: a Python loader thread releases and takes back the GIL around every C call it makes (the
 * decode, the resize, the flip, the CHW split), and on a two-core machine a thread that finds the GIL
 * taken sleeps and is woken, so two threads gave 1.2-1.8x one. Here the GIL is released once per
 * batch (the caller is a ctypes CDLL function) and no Python runs per sample.
 *
 * The pixels are those of the Python path (data/libturbojpeg.py's region decode, then
 * data/augment.py's `render`): the same decode, the same region arithmetic, and OpenCV's resize
 * coordinates (INTER_LINEAR, INTER_AREA past a 2x shrink) in integer arithmetic of its own: within one
 * level of OpenCV's (tests/test_native_crops.py). What it does not render is handed back by its status.
 *
 * Plain C, no Python headers: loaded with ctypes. libturbojpeg is opened by path at run time
 * (ts_crops_load), the library the Python side already uses, so the handles it made work here.
 */
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TJINIT_DECOMPRESS 1
#define TJPARAM_SUBSAMP 4
#define TJPARAM_JPEGWIDTH 5
#define TJPARAM_JPEGHEIGHT 6
#define TJPARAM_FASTUPSAMPLE 9
#define TJPARAM_FASTDCT 10
#define TJPF_RGB 0

enum { OK = 0, SIZE_REFUSED = 1, BAD_HEADER = 2, BAD_DATA = 3, BAD_REGION = 4, NO_MEMORY = 5, BAD_BOX = 6,
       SIZE_MISMATCH = 7, CANNOT_CROP = 8, MIXED_SCALE = 9 };

typedef struct { int num, denom; } tj_scale;
typedef struct { int x, y, w, h; } tj_region;

static void *(*tj_init)(int);
static void (*tj_destroy)(void *);
static int (*tj_set)(void *, int, int);
static int (*tj_get)(void *, int);
static int (*tj_header)(void *, const unsigned char *, size_t);
static int (*tj_set_scale)(void *, tj_scale);
static int (*tj_set_crop)(void *, tj_region);
static int (*tj_decode)(void *, const unsigned char *, size_t, unsigned char *, int, int);

/* The column grid of a crop's left edge by TJSAMP (444, 422, 420, GRAY, 440, 411, 441): the iMCU width, but 32
 * for 4:4:4, which libjpeg-turbo also calls a JPEG whose components share factors other than 1x1 (all 2x1: an
 * iMCU of 16 columns); 32 is a multiple of every such width (data/libturbojpeg.py's _MCU_WIDTH). */
static const int MCU_WIDTH[7] = {32, 16, 16, 8, 8, 32, 8};

/* 0 when libturbojpeg at `path` has every function used here. */
int ts_crops_load(const char *path) {
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib) return -1;
    *(void **)&tj_init = dlsym(lib, "tj3Init");
    *(void **)&tj_destroy = dlsym(lib, "tj3Destroy");
    *(void **)&tj_set = dlsym(lib, "tj3Set");
    *(void **)&tj_get = dlsym(lib, "tj3Get");
    *(void **)&tj_header = dlsym(lib, "tj3DecompressHeader");
    *(void **)&tj_set_scale = dlsym(lib, "tj3SetScalingFactor");
    *(void **)&tj_set_crop = dlsym(lib, "tj3SetCroppingRegion");
    *(void **)&tj_decode = dlsym(lib, "tj3Decompress8");
    return (tj_init && tj_destroy && tj_set && tj_get && tj_header && tj_set_scale && tj_set_crop && tj_decode) ? 0 : -2;
}

static int ceil_div(int a, int b) { return (a + b - 1) / b; }
static int imin(int a, int b) { return a < b ? a : b; }
static int imax(int a, int b) { return a > b ? a : b; }

/* Largest denominator of 8, 4, 2 keeping the image >= (min_h, min_w), else 1 (libturbojpeg.dct_factor). */
static int dct_factor(int h, int w, int min_h, int min_w) {
    static const int scales[3] = {8, 4, 2};
    for (int i = 0; i < 3; i++)
        if (ceil_div(h, scales[i]) >= min_h && ceil_div(w, scales[i]) >= min_w) return scales[i];
    return 1;
}

/* One axis of a resize: output i reads taps idx[i*k .. i*k+k-1] with weights wt[...] (unused taps: weight 0). */
typedef struct { int k; int *idx; float *wt; } axis_t;

static int axis_alloc(axis_t *a, int out, int k) {
    a->k = k;
    a->idx = malloc(sizeof(int) * (size_t)out * k);
    a->wt = malloc(sizeof(float) * (size_t)out * k);
    if (!a->idx || !a->wt) return -1;
    for (int i = 0; i < out * k; i++) { a->idx[i] = 0; a->wt[i] = 0.f; }
    return 0;
}

static void axis_free(axis_t *a) { free(a->idx); free(a->wt); a->idx = NULL; a->wt = NULL; }

/* OpenCV's INTER_LINEAR coordinates: two taps, the border replicated. */
static int axis_linear(axis_t *a, int src, int dst) {
    if (axis_alloc(a, dst, 2)) return -1;
    double scale = (double)src / dst;
    for (int d = 0; d < dst; d++) {
        double f = (d + 0.5) * scale - 0.5;
        int s = (int)floor(f);
        f -= s;
        if (s < 0) { f = 0; s = 0; }
        if (s >= src - 1) { f = 0; s = src - 1; }
        a->idx[2 * d] = s;
        a->idx[2 * d + 1] = imin(s + 1, src - 1);
        a->wt[2 * d] = (float)(1 - f);
        a->wt[2 * d + 1] = (float)f;
    }
    return 0;
}

/* OpenCV's INTER_AREA shrink (computeResizeAreaTab): each output averages the source cells it covers. */
static int axis_area(axis_t *a, int src, int dst) {
    double scale = (double)src / dst;
    int k = (int)ceil(scale) + 2;
    if (axis_alloc(a, dst, k)) return -1;
    for (int d = 0; d < dst; d++) {
        double f1 = d * scale, f2 = f1 + scale, cell = fmin(scale, src - f1);
        int s1 = (int)ceil(f1), s2 = imin((int)floor(f2), src - 1), n = 0;
        s1 = imin(s1, s2);
        int *idx = a->idx + d * k;
        float *wt = a->wt + d * k;
        if (s1 - f1 > 1e-3) { idx[n] = s1 - 1; wt[n++] = (float)((s1 - f1) / cell); }
        for (int s = s1; s < s2; s++) { idx[n] = s; wt[n++] = (float)(1.0 / cell); }
        if (f2 - s2 > 1e-3) { idx[n] = s2; wt[n++] = (float)(fmin(fmin(f2 - s2, 1.0), cell) / cell); }
        for (; n < k; n++) idx[n] = idx[0];
    }
    return 0;
}

/* The resize in integers: the horizontal pass to 16-bit values with 8 fractional bits (weights of 8
 * bits, as OpenCV's INTER_LINEAR_EXACT), the vertical pass with 15-bit weights and a rounding shift.
 * SSE2 code for the two-tap horizontal pass (every INTER_LINEAR resize), the vertical pass and the
 * RGBX -> planes shuffle; the same arithmetic in plain C elsewhere, so the pixels are the same. */
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Horizontal, two taps on adjacent pixels: d[4x..4x+2] = p[hoff[x]] * (256 - w1) + p[hoff[x] + 3] * w1 for
 * R, G, B (lane 3: unused). Reads 8 bytes at each hoff[x]. */
static void horizontal_pair(const uint8_t *s, const int *hoff, const uint16_t *hw, int ow, uint16_t *d) {
#if defined(__SSE2__)
    const __m128i zero = _mm_setzero_si128();
    int x = 0;
    for (; x + 2 <= ow; x += 2) { /* two pixels, one store */
        __m128i a = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(s + hoff[x])), zero);
        __m128i b = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(s + hoff[x + 1])), zero);
        a = _mm_mullo_epi16(a, _mm_loadu_si128((const __m128i *)(hw + 8 * x)));
        b = _mm_mullo_epi16(b, _mm_loadu_si128((const __m128i *)(hw + 8 * x + 8)));
        a = _mm_add_epi16(a, _mm_srli_si128(a, 6));
        b = _mm_add_epi16(b, _mm_srli_si128(b, 6));
        _mm_storeu_si128((__m128i *)(d + 4 * x), _mm_unpacklo_epi64(a, b));
    }
    for (; x < ow; x++) {
        __m128i v = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(s + hoff[x])), zero);
        v = _mm_mullo_epi16(v, _mm_loadu_si128((const __m128i *)(hw + 8 * x)));
        _mm_storel_epi64((__m128i *)(d + 4 * x), _mm_add_epi16(v, _mm_srli_si128(v, 6)));
    }
#else
    for (int x = 0; x < ow; x++) {
        const uint8_t *p = s + hoff[x];
        uint16_t w0 = hw[8 * x], w1 = hw[8 * x + 3];
        for (int c = 0; c < 3; c++) d[4 * x + c] = (uint16_t)(p[c] * w0 + p[c + 3] * w1);
        d[4 * x + 3] = 0;
    }
#endif
}

/* Vertical: bytes[j] = (sum_t (rows_t[j] * w15[t]) >> 16) + 64) >> 7, saturated, for j < n (a multiple of 16;
 * the rows are padded to it). */
static void vertical(const uint16_t *const *r, const uint16_t *w15, int k, int n, uint8_t *bytes) {
#if defined(__SSE2__)
    const __m128i half = _mm_set1_epi16(64);
    for (int j = 0; j < n; j += 16) {
        __m128i a = half, b = half;
        for (int t = 0; t < k; t++) {
            __m128i w = _mm_set1_epi16((short)w15[t]);
            a = _mm_add_epi16(a, _mm_mulhi_epu16(_mm_loadu_si128((const __m128i *)(r[t] + j)), w));
            b = _mm_add_epi16(b, _mm_mulhi_epu16(_mm_loadu_si128((const __m128i *)(r[t] + j + 8)), w));
        }
        _mm_storeu_si128((__m128i *)(bytes + j), _mm_packus_epi16(_mm_srli_epi16(a, 7), _mm_srli_epi16(b, 7)));
    }
#else
    for (int j = 0; j < n; j++) {
        unsigned acc = 64;
        for (int t = 0; t < k; t++) acc += (uint16_t)(((uint32_t)r[t][j] * w15[t]) >> 16);
        acc = (uint16_t)acc >> 7;
        bytes[j] = (uint8_t)(acc > 255 ? 255 : acc);
    }
#endif
}

/* ow RGBX pixels -> three planes of ow bytes (R at p, G at p + plane, B at p + 2 * plane). */
static void to_planes(const uint8_t *px, int ow, uint8_t *p, size_t plane) {
    int x = 0;
#if defined(__SSE2__)
    for (; x + 16 <= ow; x += 16) { /* a 16-pixel byte transpose in four rounds of unpacks */
        __m128i a = _mm_loadu_si128((const __m128i *)(px + 4 * x)), b = _mm_loadu_si128((const __m128i *)(px + 4 * x + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(px + 4 * x + 32)), d = _mm_loadu_si128((const __m128i *)(px + 4 * x + 48));
        for (int round = 0; round < 4; round++) { /* (a, b, c, d) <- (lo(a, c), hi(a, c), lo(b, d), hi(b, d)) */
            __m128i s0 = _mm_unpacklo_epi8(a, c), s1 = _mm_unpackhi_epi8(a, c);
            __m128i s2 = _mm_unpacklo_epi8(b, d), s3 = _mm_unpackhi_epi8(b, d);
            a = s0; b = s1; c = s2; d = s3;
        }
        _mm_storeu_si128((__m128i *)(p + x), a);
        _mm_storeu_si128((__m128i *)(p + plane + x), b);
        _mm_storeu_si128((__m128i *)(p + 2 * plane + x), c);
    }
#endif
    for (; x < ow; x++) {
        p[x] = px[4 * x];
        p[plane + x] = px[4 * x + 1];
        p[2 * plane + x] = px[4 * x + 2];
    }
}

#define MAX_TAPS 256

static size_t round16(size_t n) { return (n + 15) & ~(size_t)15; }

/* Bytes of scratch `resize_into` needs for an h-row source and an oh x ow output. */
static size_t resize_scratch(int h, int ow) {
    size_t lanes = round16((size_t)ow * 4);
    return round16(sizeof(int) * ow) + round16(sizeof(uint16_t) * 8 * ow) + sizeof(uint16_t) * lanes * h +
           lanes + round16((size_t)ow * 3) + 64;
}

/* Where one crop goes: its slot of a uint8 batch (`bytes`), or of a float batch (`floats`), normalised
 * there as x * scale[c] + shift[c] (`scale_row`, `shift_row`: the same tiled over an HWC row of ow pixels);
 * CHW (three planes) or HWC. */
typedef struct {
    int chw;
    uint8_t *bytes;
    float *floats;
    const float *scale, *shift, *scale_row, *shift_row;
} target_t;

/* n bytes to floats, b[j] * scale[j] + shift[j] (a multiply, then an add: torch's two passes, bit for bit) */
static void affine_row(const uint8_t *b, int n, const float *scale, const float *shift, float *o) {
    for (int j = 0; j < n; j++) o[j] = (float)b[j] * scale[j] + shift[j];
}

static void affine_plane(const uint8_t *b, int n, float scale, float shift, float *o) {
    int j = 0;
#if defined(__SSE2__)
    if (((uintptr_t)o & 15) == 0) { /* streaming stores: the batch is read later, by the model, not now */
        const __m128 s = _mm_set1_ps(scale), t = _mm_set1_ps(shift);
        const __m128i zero = _mm_setzero_si128();
        for (; j + 16 <= n; j += 16) {
            __m128i v = _mm_loadu_si128((const __m128i *)(b + j));
            __m128i lo = _mm_unpacklo_epi8(v, zero), hi = _mm_unpackhi_epi8(v, zero);
            _mm_stream_ps(o + j, _mm_add_ps(_mm_mul_ps(_mm_cvtepi32_ps(_mm_unpacklo_epi16(lo, zero)), s), t));
            _mm_stream_ps(o + j + 4, _mm_add_ps(_mm_mul_ps(_mm_cvtepi32_ps(_mm_unpackhi_epi16(lo, zero)), s), t));
            _mm_stream_ps(o + j + 8, _mm_add_ps(_mm_mul_ps(_mm_cvtepi32_ps(_mm_unpacklo_epi16(hi, zero)), s), t));
            _mm_stream_ps(o + j + 12, _mm_add_ps(_mm_mul_ps(_mm_cvtepi32_ps(_mm_unpackhi_epi16(hi, zero)), s), t));
        }
    }
#endif
    for (; j < n; j++) o[j] = (float)b[j] * scale + shift;
}

/* ow RGBX pixels -> ow RGB pixels (3 x ow bytes) */
static void to_hwc(const uint8_t *px, int ow, uint8_t *o) {
    for (int x = 0; x + 1 < ow; x++) memcpy(o + 3 * x, px + 4 * x, 4); /* the 4th byte: the next pixel's */
    memcpy(o + 3 * (ow - 1), px + 4 * (ow - 1), 3);
}

/* Resize the h x w RGB region at `src` (row stride `stride` bytes; 8 bytes readable from each pixel on)
 * to oh x ow, flipped left-right if asked, into `to`. 0, -1 without memory, -2 for a mixed scale (below). */
static int resize_into(const uint8_t *src, int stride, int h, int w, int oh, int ow, int flip, const target_t *to,
                       uint8_t *scratch) {
    axis_t ax = {0}, ay = {0};
    int area = h > 2 * oh || w > 2 * ow, shrink = h >= oh && w >= ow, rc = 0;
    const uint16_t *taps[MAX_TAPS];
    uint16_t w15[MAX_TAPS];
    /* a shrink past 2x on one axis and a growth on the other: OpenCV's INTER_AREA then follows rules of its own
     * version (5.0 differs from 4.x by up to 200 levels here), so that rare box is left to it (a fancy crop box;
     * RandomResizedCrop's aspect ratios never make one) */
    if (area && !shrink) return -2;
    if ((area ? (axis_area(&ax, w, ow) || axis_area(&ay, h, oh))
              : (axis_linear(&ax, w, ow) || axis_linear(&ay, h, oh))) ||
        ay.k > MAX_TAPS) { /* a shrink of over 250x after DCT scaling: left to the caller */
        rc = -1;
        goto done;
    }
    size_t lanes = round16((size_t)ow * 4);
    int *hoff = (int *)scratch;
    uint16_t *hw = (uint16_t *)(scratch + round16(sizeof(int) * ow));
    uint16_t *rows = hw + round16(sizeof(uint16_t) * 8 * ow) / sizeof(uint16_t);
    uint8_t *px = (uint8_t *)(rows + lanes * h), *staged = px + lanes;
    /* the horizontal taps, in output order (a flip reverses them); pairs of adjacent pixels or not */
    int pairs = ax.k == 2;
    for (int x = 0; x < ow; x++) {
        int sx = flip ? ow - 1 - x : x, i0 = ax.idx[2 * sx];
        if (pairs && ax.idx[2 * sx + 1] != i0 + 1 && ax.wt[2 * sx + 1] != 0.f) pairs = 0;
        if (!pairs) break;
        uint16_t w1 = (uint16_t)lrintf(ax.wt[2 * sx + 1] * 256.f), w0 = (uint16_t)(256 - w1);
        uint16_t wv[8] = {w0, w0, w0, w1, w1, w1, 0, 0};
        memcpy(hw + 8 * x, wv, sizeof wv);
        hoff[x] = 3 * i0;
    }
    /* horizontal: each source row the vertical taps read */
    int lo = h, hi = -1;
    for (int i = 0; i < oh * ay.k; i++)
        if (ay.wt[i] != 0.f || i % ay.k == 0) { lo = imin(lo, ay.idx[i]); hi = imax(hi, ay.idx[i]); }
    for (int r = lo; r <= hi; r++) {
        const uint8_t *s = src + (size_t)r * stride;
        uint16_t *d = rows + (size_t)(r - lo) * lanes;
        if (pairs) {
            horizontal_pair(s, hoff, hw, ow, d);
            continue;
        }
        for (int x = 0; x < ow; x++) {
            int sx = flip ? ow - 1 - x : x;
            float acc[3] = {0, 0, 0};
            for (int t = 0; t < ax.k; t++) {
                const uint8_t *p = s + 3 * ax.idx[sx * ax.k + t];
                float wt = ax.wt[sx * ax.k + t];
                for (int c = 0; c < 3; c++) acc[c] += wt * p[c];
            }
            for (int c = 0; c < 3; c++) d[4 * x + c] = (uint16_t)lrintf(fminf(acc[c] * 256.f, 65280.f));
            d[4 * x + 3] = 0;
        }
    }
    /* vertical, then the layout */
    size_t plane = (size_t)oh * ow;
    for (int y = 0; y < oh; y++) {
        for (int t = 0; t < ay.k; t++) {
            taps[t] = rows + (size_t)(ay.idx[y * ay.k + t] - lo) * lanes;
            w15[t] = (uint16_t)lrintf(ay.wt[y * ay.k + t] * 32768.f);
        }
        vertical(taps, w15, ay.k, (int)lanes, px);
        if (to->floats && to->chw) {
            to_planes(px, ow, staged, (size_t)ow);
            for (int c = 0; c < 3; c++)
                affine_plane(staged + c * ow, ow, to->scale[c], to->shift[c], to->floats + c * plane + (size_t)y * ow);
        } else if (to->floats) {
            to_hwc(px, ow, staged);
            affine_row(staged, 3 * ow, to->scale_row, to->shift_row, to->floats + (size_t)y * ow * 3);
        } else if (to->chw) {
            to_planes(px, ow, to->bytes + (size_t)y * ow, plane);
        } else {
            to_hwc(px, ow, to->bytes + (size_t)y * ow * 3);
        }
    }
done:
    axis_free(&ax);
    axis_free(&ay);
    return rc;
}

/* A decompressor with the Python path's settings: fast DCT, smooth upsampling (see data/libturbojpeg.py). */
static void *new_handle(void) {
    void *handle = tj_init(TJINIT_DECOMPRESS);
    if (handle && (tj_set(handle, TJPARAM_FASTUPSAMPLE, 0) != 0 || tj_set(handle, TJPARAM_FASTDCT, 1) != 0)) {
        tj_destroy(handle);
        handle = NULL;
    }
    return handle;
}

/* Each thread's decompressor and scratch (the decoded part, the resize rows), kept from one call to the
 * next and freed when the thread ends: fresh pages for every batch cost a page fault each. */
typedef struct {
    void *handle, *img, *rows;
    size_t img_cap, rows_cap;
} scratch_t;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p) {
    scratch_t *s = p;
    if (s->handle) tj_destroy(s->handle);
    free(s->img);
    free(s->rows);
    free(s);
}

static void scratch_key_make(void) { pthread_key_create(&scratch_key, scratch_free); }

static scratch_t *thread_scratch(void) {
    pthread_once(&scratch_once, scratch_key_make);
    scratch_t *s = pthread_getspecific(scratch_key);
    if (!s && (s = calloc(1, sizeof *s)) && pthread_setspecific(scratch_key, s) != 0) {
        free(s);
        s = NULL;
    }
    return s;
}

static int grow(void **buf, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    void *p = malloc(need + need / 4);
    if (!p) return -1;
    free(*buf);
    *buf = p;
    *cap = need + need / 4;
    return 0;
}

/* Render n samples into `out` (n slots of 3 x oh x ow uint8, CHW if `chw` else HWC), or, when `fout` is
 * given, into `fout` (float slots) normalised as x * norm_scale[c] + norm_shift[c]. Sample i: JPEG bytes
 * data[offsets[i]:offsets[i+1]]; info[7i..7i+6] = stored height, width, then its box's top, left,
 * height, width and flip. status[i] = 0 when rendered, else why not (its slot is left as it was;
 * the caller decodes it again in Python for the message, or whole): a box that is empty or leaves the
 * stored size, a JPEG whose size is not the stored one, a size over `max_pixels`, a chroma layout the
 * TurboJPEG API does not name (no column grid to crop on), data that does not decode. Returns how
 * many failed, -1 when no decompressor could be made, -2 for an output of no pixels. The thread's decompressor is replaced after a failure: a libjpeg-turbo 3.0
 * decompressor that failed to read a header keeps the old image's size for the next. */
int ts_crops_render(int n, const uint8_t *data, const int64_t *offsets, const int32_t *info, int oh, int ow,
                    int chw, int64_t max_pixels, uint8_t *out, float *fout, const float *norm_scale,
                    const float *norm_shift, int32_t *status) {
    scratch_t *scratch = thread_scratch();
    if (scratch && !scratch->handle) scratch->handle = new_handle();
    void *handle = scratch ? scratch->handle : NULL;
    if (n < 0 || oh <= 0 || ow <= 0) return -2; /* no output to render into */
    float *rowwise = fout && !chw ? malloc(sizeof(float) * 6 * ow) : NULL;
    int failed = 0;
    size_t slot = (size_t)3 * oh * ow;
    if (!handle || (fout && !chw && !rowwise)) {
        free(rowwise);
        return -1;
    }
    if (rowwise)
        for (int j = 0; j < 3 * ow; j++) { rowwise[j] = norm_scale[j % 3]; rowwise[3 * ow + j] = norm_shift[j % 3]; }
    for (int i = 0; i < n; i++) {
        const int32_t *f = info + 7 * i;
        int h = f[0], w = f[1], top = f[2], left = f[3], bh = f[4], bw = f[5], flip = f[6];
        const uint8_t *jpeg = data + offsets[i];
        size_t len = (size_t)(offsets[i + 1] - offsets[i]);
        int st = OK;
        /* a box of at least one pixel inside the stored size (the renderer is public: boxes are not only ours) */
        if (h <= 0 || w <= 0 || bh <= 0 || bw <= 0 || top < 0 || left < 0 || top > h - bh || left > w - bw) {
            st = BAD_BOX;
            goto next;
        }
        /* needed_size: the smallest power-of-two DCT scale on which the box still covers the output */
        int s = dct_factor(h, w, (int)ceil((double)h * oh / bh), (int)ceil((double)w * ow / bw));
        int min_h = s > 1 ? ceil_div(h, s) : 0, min_w = s > 1 ? ceil_div(w, s) : 0;
        if (tj_header(handle, jpeg, len) != 0) { st = BAD_HEADER; goto next; }
        int width = tj_get(handle, TJPARAM_JPEGWIDTH), height = tj_get(handle, TJPARAM_JPEGHEIGHT);
        if (width <= 0 || height <= 0 || (int64_t)width * height > max_pixels) { st = SIZE_REFUSED; goto next; }
        if (width != w || height != h) { st = SIZE_MISMATCH; goto next; } /* the stored size is the JPEG's */
        int scale = (min_h > 0 || min_w > 0) ? dct_factor(height, width, min_h, min_w) : 1;
        tj_region whole = {0, 0, 0, 0};
        tj_scale sf = {1, scale};
        if (tj_set_crop(handle, whole) != 0 || tj_set_scale(handle, sf) != 0) { st = BAD_REGION; goto next; }
        int fh = ceil_div(height, scale), fw = ceil_div(width, scale);
        /* the part the box needs, one pixel of margin each side, left edge on an iMCU column */
        int subsamp = tj_get(handle, TJPARAM_SUBSAMP);
        /* a chroma layout it does not name has no column grid to crop on: the Python path decodes it whole */
        if (subsamp < 0 || subsamp >= 7) { st = CANNOT_CROP; goto next; }
        int mcu = ceil_div(MCU_WIDTH[subsamp], scale);
        int y0 = imin(fh - 1, imax(0, (int)((int64_t)top * fh / height) - 1));
        int x0 = imin(fw - 1, imax(0, (int)((int64_t)left * fw / width) - 1)) / mcu * mcu;
        int ph = imin(fh, (int)(((int64_t)(top + bh) * fh + height - 1) / height) + 1) - y0;
        int pw = imin(fw, (int)(((int64_t)(left + bw) * fw + width - 1) / width) + 1) - x0;
        if (ph != fh || pw != fw) {
            tj_region crop = {x0, y0, pw, ph};
            if (tj_set_crop(handle, crop) != 0) { st = BAD_REGION; goto next; }
        }
        if (grow(&scratch->img, &scratch->img_cap, (size_t)ph * pw * 3 + 16)) { st = NO_MEMORY; goto next; }
        uint8_t *img = scratch->img;
        if (tj_decode(handle, jpeg, len, img, pw * 3, TJPF_RGB) != 0) { st = BAD_DATA; goto next; }
        /* render: the box mapped onto the decoded part (augment.render) */
        double sh = (double)fh / h, sw = (double)fw / w;
        int t = (int)(top * sh), l = (int)(left * sw);
        int rh = imax(1, imin(fh - t, (int)nearbyint(bh * sh)));
        int rw = imax(1, imin(fw - l, (int)nearbyint(bw * sw)));
        t -= y0;
        l -= x0;
        if (t < 0 || l < 0 || t >= ph || l >= pw) { st = BAD_REGION; goto next; }
        rh = imin(rh, ph - t);
        rw = imin(rw, pw - l);
        target_t to = {chw, fout ? NULL : out + slot * i, fout ? fout + slot * i : NULL, norm_scale, norm_shift,
                       rowwise, rowwise ? rowwise + 3 * ow : NULL};
        if (grow(&scratch->rows, &scratch->rows_cap, resize_scratch(rh, ow))) { st = NO_MEMORY; goto next; }
        int resized = resize_into(img + ((size_t)t * pw + l) * 3, pw * 3, rh, rw, oh, ow, flip, &to, scratch->rows);
        if (resized) st = resized == -2 ? MIXED_SCALE : NO_MEMORY;
    next:
        status[i] = st;
        failed += st != OK;
        if (st != OK) {
            tj_destroy(handle);
            if (!(handle = scratch->handle = new_handle())) {
                for (int j = i + 1; j < n; j++) status[j] = NO_MEMORY;
                failed += n - 1 - i;
                break;
            }
        }
    }
    free(rowwise);
#if defined(__SSE2__)
    _mm_sfence(); /* the streaming stores are visible before the batch is handed on */
#endif
    return failed;
}
