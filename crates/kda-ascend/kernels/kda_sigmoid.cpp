// BFG post-process, beta: y = 1 / (1 + exp(-x)) in fp32 over the beta columns of the BFG output
// (a strided [T, lh] view: rows of lh contiguous bf16/f16/f32, row stride = BFG width). The
// split into B | F | G is free (views); only beta is computed. Units: elements, row-major.
#include "kda_kernel_abi.h"

using namespace AscendC;

struct SigmoidArgs {
    ArgsHeader h;
    GmTensor x;  // [T, lh] (any float)
    GmTensor y;  // [T, lh] f32, dense
};

template <typename T>
class Sigmoid {
public:
    __aicore__ inline void Run(const SigmoidArgs &a)
    {
        uint32_t start, count;
        kda_share(a.h.tiling, start, count);
        const uint32_t tile = a.h.tiling.tile;
        const int64_t cols = a.x.shape[a.x.rank - 1];
        const int64_t row_stride = a.x.rank > 1 ? a.x.strides[a.x.rank - 2] : cols;
        x_.SetGlobalBuffer(kda_gm<T>(a.x));
        y_.SetGlobalBuffer(kda_gm<float>(a.y));
        pipe_.InitBuffer(in_, 2, tile * sizeof(T));
        pipe_.InitBuffer(out_, 2, tile * sizeof(float));
        pipe_.InitBuffer(tmp_, tile * sizeof(float));
        for (uint32_t done = 0; done < count;) {
            // One tile never crosses a row: the view is contiguous only within rows.
            uint32_t i = start + done;
            int64_t row = i / cols, col = i % cols;
            uint32_t n = min(tile, min(count - done, static_cast<uint32_t>(cols - col)));
            LocalTensor<T> xin = in_.AllocTensor<T>();
            DataCopy(xin, x_[row * row_stride + col], n);
            in_.EnQue(xin);
            xin = in_.DeQue<T>();
            LocalTensor<float> f = tmp_.Get<float>();
            LocalTensor<float> yout = out_.AllocTensor<float>();
            if constexpr (sizeof(T) == sizeof(float)) {
                DataCopy(f, xin, n);
            } else {
                Cast(f, xin, RoundMode::CAST_NONE, n);  // widening is exact
            }
            Muls(f, f, -1.0f, n);
            Exp(f, f, n);
            Adds(f, f, 1.0f, n);
            Duplicate(yout, 1.0f, n);
            Div(yout, yout, f, n);
            in_.FreeTensor(xin);
            out_.EnQue(yout);
            yout = out_.DeQue<float>();
            DataCopy(y_[i], yout, n);
            out_.FreeTensor(yout);
            done += n;
        }
    }

private:
    TPipe pipe_;
    TQue<QuePosition::VECIN, 2> in_;
    TQue<QuePosition::VECOUT, 2> out_;
    TBuf<TPosition::VECCALC> tmp_;
    GlobalTensor<T> x_;
    GlobalTensor<float> y_;
};

template <typename T>
__aicore__ inline void sigmoid(const SigmoidArgs &args)
{
    Sigmoid<T> k;
    k.Run(args);
}

extern "C" __global__ __aicore__ void kda_sigmoid_f32(GM_ADDR x, GM_ADDR y, GM_ADDR meta)
{
    KDA_VECTOR_KERNEL();
    SigmoidArgs args;
    GM_ADDR tensors[] = {x, y};
    kda_load_args(args, meta, tensors, 2);
    KDA_FOR_FLOAT_DTYPE(args.x.dtype, sigmoid, args);
}
