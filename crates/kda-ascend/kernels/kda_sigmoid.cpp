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

// Not `Sigmoid`: with `using namespace AscendC` that name is ambiguous with the advanced API's
// `AscendC::Sigmoid` (asc-devkit include/adv_api/activation/sigmoid.h).
template <typename T>
class SigmoidKernel {
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
            // Plain comparisons: no bare min on the AI Core.
            uint32_t left = static_cast<uint32_t>(cols - col);
            uint32_t n = count - done < left ? count - done : left;
            n = tile < n ? tile : n;
            LocalTensor<T> xin = in_.AllocTensor<T>();
            // DataCopyPad: a tail whose byte length is not a multiple of 32 is copied whole.
            DataCopyPad(xin, x_[row * row_stride + col],
                        DataCopyExtParams{1, static_cast<uint32_t>(n * sizeof(T)), 0, 0, 0},
                        DataCopyPadExtParams<T>{false, 0, 0, 0});
            in_.EnQue(xin);
            xin = in_.DeQue<T>();
            LocalTensor<float> f = tmp_.Get<float>();
            LocalTensor<float> yout = out_.AllocTensor<float>();
            if constexpr (sizeof(T) == sizeof(float)) {
                Muls(f, xin, 1.0f, n);  // UB to UB: no 32-byte length rule
            } else {
                Cast(f, xin, RoundMode::CAST_NONE, n);  // widening is exact
            }
            PipeBarrier<PIPE_V>();
            Muls(f, f, -1.0f, n);
            PipeBarrier<PIPE_V>();
            Exp(f, f, n);
            PipeBarrier<PIPE_V>();
            Adds(f, f, 1.0f, n);
            Duplicate(yout, 1.0f, n);
            PipeBarrier<PIPE_V>();
            Div(yout, yout, f, n);
            in_.FreeTensor(xin);
            out_.EnQue(yout);
            yout = out_.DeQue<float>();
            DataCopyPad(y_[i], yout, DataCopyExtParams{1, static_cast<uint32_t>(n * sizeof(float)), 0, 0, 0});
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
    SigmoidKernel<T> k;
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
